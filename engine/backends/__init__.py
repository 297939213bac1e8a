"""The backends that run the model's operations (numpy reference, cpu with C kernels, ...)."""
