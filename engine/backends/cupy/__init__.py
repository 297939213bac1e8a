"""The cupy backend (CUDA): registered now, its ops come with a later issue."""
