"""The OpenAI-compatible HTTP server: ``create_app(async_engine, config)`` and the serve/ps/bench CLI.

Imports are lazy so that ``computron ps`` and a benchmark's client process load neither torch
nor FastAPI.
"""

__all__ = ["create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
