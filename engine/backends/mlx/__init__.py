"""The mlx backend (Apple Silicon): registered now, its ops come with issue 20."""
