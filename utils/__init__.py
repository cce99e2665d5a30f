"""Below everything: errors, files and locks, progress, stop signals, metric writer, allocator, TFDS names."""
