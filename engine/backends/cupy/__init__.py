"""The cupy backend: the forward pass on a CUDA GPU through CuPy and the kernels of cuda_kernels/;
DS4_CUDA_EMULATE=1 runs it on the host (a NumPy-backed CuPy stand-in, the kernels as host C++)."""
