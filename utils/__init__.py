"""Small shared pieces below everything: errors, files and locks, progress, stop signals, metric writer, allocator."""
