"""WeightLayout: where each parameter of one model shard sits inside its flat byte image.

Parameters are laid out group by group (embeddings, layer 0, ..., layer L-1, head), each at an
aligned offset, so one layer group is one contiguous byte range: a swap copies a few large
ranges, and compute on group *i* waits only for range *i*. The same layout describes the
pinned host image and the GPU region, so a swap is a straight byte copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.config import ModelConfig
from ..models.transformer import TORCH_DTYPES, DecoderLM, parameter_groups
from .units import align_up


@dataclass(frozen=True)
class Entry:
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class WeightLayout:
    entries: tuple[Entry, ...]
    groups: tuple[tuple[int, int], ...]  # [start, end) byte range of each swap group
    nbytes: int

    @classmethod
    def of(cls, model: DecoderLM, dtype: torch.dtype) -> "WeightLayout":
        entries, groups, off = [], [], 0
        for group in parameter_groups(model):
            start = off
            for name, p in group:
                entries.append(Entry(name, off, tuple(p.shape), dtype))
                off = align_up(off + entries[-1].nbytes)
            groups.append((start, off))
        return cls(tuple(entries), tuple(groups), off)

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of every parameter into a flat uint8 buffer of ``nbytes`` bytes."""
        if buf.dtype != torch.uint8 or buf.numel() < self.nbytes:
            raise ValueError(f"need a uint8 buffer of {self.nbytes} bytes, got {buf.dtype} x {buf.numel()}")
        return {e.name: buf[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries}

    @property
    def num_params(self) -> int:
        return sum(e.nbytes // e.dtype.itemsize for e in self.entries)


def layout_for(cfg: ModelConfig) -> WeightLayout:
    """The layout of a model's weights in its own dtype (built on the meta device: no memory)."""
    return WeightLayout.of(DecoderLM(cfg), TORCH_DTYPES[cfg.dtype])
