"""Computron: serve many large models on shared GPUs, swapping weights from pinned host memory."""

__version__ = "0.1.0"
