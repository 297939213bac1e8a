"""The DeepSeek V4 Flash engine: GGUF files, quant formats, tensors and (later) the forward pass.

It knows nothing of chat, HTTP, tools or the UI; only this package touches arrays.
"""
from .config import ModelConfig
from .errors import ModelFileError
from .model_file import ModelFile, QTensor

__all__ = ["ModelConfig", "ModelFile", "ModelFileError", "QTensor"]
