"""The CPU backend: float32 vectorized ops and the C kernels (engine.backends.cpu._kernels)."""
