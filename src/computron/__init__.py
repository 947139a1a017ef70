"""Computron: serve many large models on shared GPUs, swapping weights from pinned host memory."""

__version__ = "0.1.0"

import os as _os

if _os.environ.get("COMPUTRON_COMPILED", "") not in ("", "0"):  # opt-in: the mypyc build (computron/_fast.py)
    from . import _fast

    _fast.enable_if_requested()
