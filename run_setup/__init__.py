"""A run's set-up, shared by training, evaluation and inference: settings, input kinds, cluster and mesh, sharding, preflight checks, checkpoints, the Run."""
