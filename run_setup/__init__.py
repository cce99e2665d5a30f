"""A run's set-up: settings, input kinds, cluster and mesh, sharding, preflight checks, checkpoints, the Run."""
