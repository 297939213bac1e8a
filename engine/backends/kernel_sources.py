"""Where the GPU kernel sources are: the top-level packages `metal_kernels` and `cuda_kernels`
(package data, next to `engine` in a wheel, as the design card lays them out).

They are found by name through importlib.resources, not imported: they hold no code the engine
runs. An editable install made before these packages existed does not map them, so a source
checkout falls back to the folder beside `engine/`.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

KERNEL_PACKAGES = ("metal_kernels", "cuda_kernels")


def kernel_dir(package: str):
    """The folder of a kernel package (a Traversable; a Path in a checkout or an unzipped wheel)."""
    if package not in KERNEL_PACKAGES:
        raise ValueError(f"unknown kernel package {package!r}")
    try:
        return resources.files(package)
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / package


def read_source(package: str, name: str) -> str:
    return kernel_dir(package).joinpath(name).read_text()
