"""The DeepSeek V4 Flash engine: GGUF files, quant formats, tensors and (later) the forward pass.

It knows nothing of chat, HTTP, tools or the UI; only this package touches arrays.
"""
from .config import ModelConfig
from .errors import ModelFileError
from .model_file import ModelFile, QTensor
from .sampling import Rng, SamplingParams
from .session import ContextFull, Engine, Session
from .snapshot import SnapshotError
from .tokenizer import Tokenizer

__all__ = ["ContextFull", "Engine", "ModelConfig", "ModelFile", "ModelFileError", "QTensor", "Rng",
           "SamplingParams", "Session", "SnapshotError", "Tokenizer"]
