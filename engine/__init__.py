"""The engine: the training loop and step, evaluating a split (eval and predict modes), the restored model."""
