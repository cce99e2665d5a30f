"""The run's set-up, shared by training, evaluation and inference: the cluster and its mesh
(`cluster`), where parameters and optimizer state live on it (`sharding`), the checks made before
anything is read or written (`preflight`), and the `Run` itself: data, vocabulary, model,
checkpoints (`run`)."""
