"""A run's set-up: settings, flags, input kinds, checks, compatibility, mesh, sharding, checkpoints, the Run."""
