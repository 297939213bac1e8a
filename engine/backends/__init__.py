"""The backends that run the model's operations (numpy reference, cpu with C kernels, ...): the
registry (which exist, which can serve here, `auto`'s choice) and the protocol every one meets."""
from .protocol import OPERATIONS, BindReport, Ops
from .registry import AUTO, Backend, available_names, check_ops, describe, get, make_ops, names, pick, register

__all__ = ["AUTO", "OPERATIONS", "Backend", "BindReport", "Ops", "available_names", "check_ops", "describe",
           "get", "make_ops", "names", "pick", "register"]
