"""Small shared pieces below everything else: errors, whole-or-absent files and locks, progress lines, stop signals, the metric writer, the allocator, TFDS catalog names."""
