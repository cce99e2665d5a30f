"""Scripts a user runs apart from training: preparing TFDS catalog datasets, comparing two run folders."""
