"""Sharding plans: which layers and which slice of each parameter one rank of a TP x PP layout holds.

What flows through: a ``ModelConfig``, a ``ParallelDims`` and a rank (``rank = stage * tp +
tensor_rank``, as in ``messages.Placement``) become a :class:`Shard`: the stage's contiguous
layer range, the shard's own ``ModelConfig`` (heads, MLP width and vocabulary divided; only the
stage's layers), and for each parameter of the shard a :class:`Cut` that says how it is cut from
the full tensor. Pure Python (no torch import) except :func:`cut_tensor`, which applies a cut to
a tensor-like object (a tensor or a safetensors slice).

The cuts (Megatron-style):

- attention by heads: the fused ``qkv`` is column parallel (rows of the query heads of this rank,
  then its key heads, then its value heads); with ``tp > kv_heads`` each rank keeps the one
  key/value head its query heads read (grouped-query attention); ``o`` is row parallel;
- MLP: ``up`` column parallel (gated: the gate half and the up half each split, so every rank
  keeps ``[gate; up]``), ``down`` row parallel;
- row-parallel biases (``o_bias``, ``down_bias``) live on tensor rank 0 only (zeros elsewhere),
  so the all-reduce adds them once;
- embeddings and LM head vocabulary parallel: contiguous id ranges of ``ceil(vocab / tp)``, the
  last one zero-padded; tied embeddings use the same ranges for both;
- norms, learned positions and OPT's projections are replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..models.config import ModelConfig
from .dims import ParallelDims


def stage_layers(num_layers: int, pp: int, partition: list[int] | tuple[int, ...] | None = None) -> list[range]:
    """The contiguous layer range of each pipeline stage: ``partition[s]`` layers for stage s, or
    as even as possible (earlier stages take the remainder) when no partition is given."""
    if partition is None:
        base, extra = divmod(num_layers, pp)
        if base == 0:
            raise ValueError(f"pp={pp} exceeds the {num_layers} layers")
        partition = [base + (s < extra) for s in range(pp)]
    partition = list(partition)
    if len(partition) != pp:
        raise ValueError(f"a partition for pp={pp} needs {pp} stage sizes, got {len(partition)}: {partition}")
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in partition):
        raise ValueError(f"every pipeline stage needs at least one layer, got partition {partition}")
    if sum(partition) != num_layers:
        raise ValueError(f"partition {partition} covers {sum(partition)} layers, the model has {num_layers}")
    starts = [sum(partition[:s]) for s in range(pp)]
    return [range(a, a + n) for a, n in zip(starts, partition)]


def vocab_range(vocab: int, tp: int, tensor_rank: int) -> tuple[int, int, int]:
    """(start, stop, padded size) of a tensor rank's contiguous vocabulary range; every rank's
    shard has ``padded size = ceil(vocab / tp)`` rows, those past ``vocab`` are zeros."""
    size = math.ceil(vocab / tp)
    start = min(tensor_rank * size, vocab)
    return start, min(start + size, vocab), size


def kv_heads_per_rank(num_heads: int, kv_heads: int, tp: int) -> int:
    """Key/value heads a tensor rank holds: kv_heads/tp, or 1 (replicated) when tp > kv_heads."""
    return max(kv_heads // tp, 1)


def head_slices(num_heads: int, kv_heads: int, tp: int, tensor_rank: int) -> tuple[range, range]:
    """The query heads and key/value heads one tensor rank holds (indices into the full model's)."""
    if num_heads % tp or (kv_heads % tp and tp % kv_heads):
        raise ValueError(f"tp={tp} cannot split {num_heads} query heads and {kv_heads} key/value heads")
    hq = num_heads // tp
    q = range(tensor_rank * hq, (tensor_rank + 1) * hq)
    if tp <= kv_heads:
        hk = kv_heads // tp
        return q, range(tensor_rank * hk, (tensor_rank + 1) * hk)
    kv = tensor_rank // (tp // kv_heads)  # the group of this rank's query heads
    return q, range(kv, kv + 1)


@dataclass(frozen=True)
class Cut:
    """A shard of a full tensor: the ranges ``ranges`` along ``dim`` of the full tensor, laid end to
    end, then zero-padded to ``size``; ``zero``: the shard holds zeros only (nothing is read)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    size: int
    zero: bool = False

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.size if i == self.dim else n for i, n in enumerate(full))

    def numel_read(self, full: tuple[int, ...]) -> int:
        """Elements of the full tensor this cut reads (padding and zero shards read nothing)."""
        if self.zero:
            return 0
        rest = math.prod(n for i, n in enumerate(full) if i != self.dim)
        return rest * sum(b - a for a, b in self.ranges)


def whole(full: tuple[int, ...]) -> Cut:
    return Cut(0, ((0, full[0]),), full[0])


def cut_tensor(full, cut: Cut):
    """Apply ``cut`` to ``full`` (a tensor, or anything sliceable like one, e.g. a safetensors slice):
    only the cut's ranges are indexed, so a lazily read source reads only them."""
    import torch

    shape = tuple(full.get_shape()) if hasattr(full, "get_shape") else tuple(full.shape)
    out_shape = cut.shape(shape)
    if cut.zero or not cut.ranges:
        return torch.zeros(out_shape)
    index = (slice(None),) * cut.dim
    parts = [full[index + (slice(a, b),)] for a, b in cut.ranges]
    pad = cut.size - sum(b - a for a, b in cut.ranges)
    if pad:
        parts.append(parts[0].new_zeros(tuple(pad if i == cut.dim else n for i, n in enumerate(out_shape))))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=cut.dim)


@dataclass(frozen=True)
class Shard:
    """What one rank holds: its stage's layers and its tensor slice of each parameter."""

    full: ModelConfig
    dims: ParallelDims
    rank: int
    layers: range  # global indices of the stage's layers
    q_heads: range
    kv_heads: range
    vocab: tuple[int, int, int]  # start, stop, padded size

    @property
    def stage(self) -> int:
        return self.rank // self.dims.tp

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.dims.tp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.dims.pp - 1

    @property
    def config(self) -> ModelConfig:
        """The shard's own config: builds the shard's ``DecoderLM`` and sizes its KV cache."""
        c, tp = self.full, self.dims.tp
        return c.with_(num_layers=len(self.layers), num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads),
                       ffn_size=c.ffn_size // tp, vocab_size=self.vocab[2], head_size=c.head_dim)

    def global_name(self, name: str) -> str:
        """The full model's name of one of the shard's parameters (layers renumbered from 0)."""
        if name.startswith("layers."):
            i, rest = name.split(".", 2)[1:]
            return f"layers.{self.layers[int(i)]}.{rest}"
        return name

    def cut(self, name: str, full: tuple[int, ...]) -> Cut:
        """How the shard's parameter ``name`` (shard name) is cut from the full one of shape ``full``."""
        c, tp, leaf = self.full, self.dims.tp, name.rsplit(".", 1)[-1]
        if tp == 1:
            return whole(full)
        if leaf.startswith("qkv_"):  # column parallel, by heads: [q heads; k heads; v heads]
            d, hq, hk = c.head_dim, c.num_heads, c.kv_heads
            heads = [(h.start * d, h.stop * d) for h in (self.q_heads,)]
            heads += [(o + h.start * d, o + h.stop * d) for o, h in ((hq * d, self.kv_heads), ((hq + hk) * d, self.kv_heads))]
            return Cut(0, tuple(heads), sum(b - a for a, b in heads))
        if leaf.startswith("up_"):  # column parallel; gated: the gate and the up half each split
            f = c.ffn_size // tp
            lo = self.tensor_rank * f
            halves = (0, c.ffn_size) if c.gated_mlp else (0,)
            return Cut(0, tuple((h + lo, h + lo + f) for h in halves), f * len(halves))
        if leaf in ("o_weight", "down_weight"):  # row parallel: this rank's input columns
            if leaf == "o_weight":
                a, b = self.q_heads.start * c.head_dim, self.q_heads.stop * c.head_dim
            else:
                a, b = self.tensor_rank * (c.ffn_size // tp), (self.tensor_rank + 1) * (c.ffn_size // tp)
            return Cut(1, ((a, b),), b - a)
        if leaf in ("o_bias", "down_bias"):  # added once: tensor rank 0 holds it, the others zeros
            return Cut(0, ((0, full[0]),), full[0], zero=self.tensor_rank != 0)
        if name in ("embed_tokens", "lm_head"):  # vocab parallel
            start, stop, size = self.vocab
            return Cut(0, ((start, stop),) if stop > start else (), size)
        return whole(full)  # norms, learned positions, OPT's project_in/out

    def replicated(self, name: str, full: tuple[int, ...]) -> bool:
        """Whether every tensor rank holds the whole parameter (tp > 1: norms, learned positions,
        OPT's projections); a row-parallel bias is whole on tensor rank 0 only, so it is not."""
        leaf = name.rsplit(".", 1)[-1]
        return self.dims.tp > 1 and leaf not in ("o_bias", "down_bias") and self.cut(name, full) == whole(full)


def shard_for(cfg: ModelConfig, dims: ParallelDims, rank: int, partition: list[int] | None = None) -> Shard:
    """The shard of ``rank`` (``stage * tp + tensor_rank``) of ``cfg`` laid out as ``dims``."""
    if dims.dp != 1:
        raise ValueError(f"a sharded model has no data parallelism (dp={dims.dp})")
    if not 0 <= rank < dims.world_size:
        raise ValueError(f"rank {rank} is outside {dims} (world size {dims.world_size})")
    dims.validate_for(num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads)
    if cfg.ffn_size % dims.tp:
        raise ValueError(f"tp={dims.tp} does not divide the MLP width {cfg.ffn_size}")
    stage, t = divmod(rank, dims.tp)
    q, kv = head_slices(cfg.num_heads, cfg.kv_heads, dims.tp, t)
    layers = stage_layers(cfg.num_layers, dims.pp, partition)[stage]
    return Shard(cfg, dims, rank, layers, q, kv, vocab_range(cfg.vocab_size, dims.tp, t))


def uncut(parts, full: tuple[int, ...]):
    """The full tensor of shape ``full`` from ``(cut, shard)`` pairs of all tensor ranks (the inverse
    of :func:`cut_tensor`: padding dropped, zero shards skipped, replicated ranges written alike)."""
    out = parts[0][1].new_zeros(full)
    for cut, t in parts:
        if cut.zero:
            continue
        lead, offset = (slice(None),) * cut.dim, 0
        for a, b in cut.ranges:
            out[lead + (slice(a, b),)] = t[lead + (slice(offset, offset + b - a),)]
            offset += b - a
    return out
