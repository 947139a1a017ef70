"""The engine: registered models, requests, the step loop, executors and the model runner."""

from .async_engine import AsyncEngine, Delta
from .engine import Engine, EngineError, ModelEntry, Request
from .sampling import SamplingParams

__all__ = ["AsyncEngine", "Delta", "Engine", "EngineError", "ModelEntry", "Request", "SamplingParams"]
