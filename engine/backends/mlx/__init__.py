"""The mlx backend: the forward pass in mlx.core, with custom Metal kernels on Apple Silicon (docs/mlx.md)."""
