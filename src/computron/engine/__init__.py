"""The engine: text (``Engine``) over a torch-free step loop (``EngineCore``) over an executor.

Importing this package imports no torch: only the executors that hold tensors
(``engine.inprocess``, ``engine.legacy``) and what they use do.
"""

from ..messages import SamplingParams
from .async_engine import AsyncEngine, Delta
from .core import CoreRequest, EngineCore, EngineError
from .engine import Engine, ModelEntry, Request

__all__ = ["AsyncEngine", "CoreRequest", "Delta", "Engine", "EngineCore", "EngineError", "ModelEntry", "Request",
           "SamplingParams"]
