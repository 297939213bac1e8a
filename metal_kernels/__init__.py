"""The Metal kernel sources of the mlx backend (package data, read by engine/backends/mlx/metal.py
through engine.backends.kernel_sources; no code)."""
