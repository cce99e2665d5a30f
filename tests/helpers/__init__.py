"""Helpers the tests share: tiny configs, NumPy references, the workers tests start as processes."""
