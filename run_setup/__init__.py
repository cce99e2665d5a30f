"""The run's set-up, shared by training, evaluation and inference: the cluster and its mesh
(`cluster`), the checks made before anything is read or written (`preflight`), and the `Run`
itself: data, vocabulary, model, checkpoints (`run`)."""
