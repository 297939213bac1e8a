"""The DeepSeek V4 Flash inference engine, in four parts:

- gguf/      the file format: reading and checking a GGUF, the model's config, the quant formats,
             synthetic models and the ds4-gguf tool;
- model/     the model's math in model order (the forward pass) and its state: KV, snapshots,
             the bound weights, ds4's numerics;
- backends/  what runs the model's operations: numpy (the reference) and cpu (the C kernels);
- runtime/   Engine and Session (prefill, decode, rewind), the batcher (decode steps of sessions
             on several threads as one pass), sampling, the tokenizer.

It knows nothing of chat, HTTP, tools or the UI; only this package touches arrays.
"""
from .errors import BackendError, ModelFileError
from .gguf.config import ModelConfig
from .gguf.model_file import ModelFile, QTensor
from .model.snapshot import SnapshotError
from .options import EngineOptions
from .runtime.batcher import Batcher
from .runtime.sampling import Rng, SamplingParams
from .runtime.session import ContextFull, Engine, Session
from .runtime.mtp_drafter import MTPDrafter
from .runtime.speculative import Speculator
from .runtime.tokenizer import Tokenizer

__all__ = ["BackendError", "Batcher", "ContextFull", "Engine", "EngineOptions", "ModelConfig", "ModelFile", "ModelFileError",
           "MTPDrafter", "QTensor", "Rng", "SamplingParams", "Session", "SnapshotError", "Speculator", "Tokenizer"]
