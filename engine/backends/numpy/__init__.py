"""The NumPy reference backend: every operation in plain float64/float32 NumPy."""
