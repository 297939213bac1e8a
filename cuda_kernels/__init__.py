"""The CUDA kernel sources of the cupy backend (package data; README.md lists each kernel's
arguments and launch shape). No code runs from here: engine.backends.kernel_sources finds the
files, cupy.RawModule (or the host emulation, engine/backends/cupy/emu.py) compiles them."""
