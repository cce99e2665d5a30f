"""What the tests share: tiny configs, NumPy references, subprocess runs, source reading, the workers."""
