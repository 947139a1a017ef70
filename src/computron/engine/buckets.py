"""Batch sizes with a decode graph (torch-free: the simulator charges a capture per bucket too)."""

from __future__ import annotations


def buckets(max_batch: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every multiple of 16 up to ``max_batch``."""
    out = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return out + [max_batch]


def bucket_of(batch: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds ``batch`` sequences; None past the largest (no graph: eager)."""
    return next((s for s in sizes if s >= batch), None)
