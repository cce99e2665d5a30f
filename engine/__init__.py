"""The engine: the training loop and its step, evaluating a split (and --mode=eval/predict), and a restored model that translates, scores and shows attention."""
