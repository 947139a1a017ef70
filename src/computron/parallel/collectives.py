"""The collectives of a TP x PP model, applied from outside the model code.

What flows through: each rank (one process, one device) runs :class:`StageRunner.forward` on the
same step input (token ids, positions, the ``AttnBatch`` of its own KV cache). Within a stage the
tensor ranks are joined by a process group (``tp_group``); :func:`install_tp_hooks` sets the
model's hooks to an all-reduce after the row-parallel ``o``/``down`` projections and after the
vocab-parallel embedding, and to an all-gather of the vocab-parallel logits. Between stages the
hidden states ``[N, hidden]`` go point to point: tensor rank *t* of stage *s* sends to tensor rank
*t* of stage *s+1* (every tensor rank holds the same, reduced activations). The last stage returns
the logits of each sequence's last token; earlier stages return None. With tp = pp = 1 nothing
here touches ``torch.distributed``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.transformer import AttnBatch, DecoderLM, rope_tables
from .dims import ParallelDims
from .sharding import Shard


def tp_group(dims: ParallelDims, rank: int):
    """The tensor-parallel group of ``rank``'s stage (every rank must call this, in the same order)."""
    mine = None
    for stage in range(dims.pp):
        ranks = list(range(stage * dims.tp, (stage + 1) * dims.tp))
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = group
    return mine


def install_tp_hooks(model: DecoderLM, shard: Shard, group) -> None:
    """Set the model's reduce/gather hooks to collectives over ``group`` (nothing when tp = 1)."""
    tp, vocab = shard.dims.tp, shard.full.vocab_size
    if tp == 1:
        return

    def reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    def gather(x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(tp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)[..., :vocab]  # drop the last range's padding

    model.reduce = reduce if shard.first else None
    model.gather = gather if shard.last else None
    for layer in model.layers:
        layer.attn.reduce = layer.mlp.reduce = reduce


class StageRunner:
    """One rank's forward pass: receive (or embed), run the stage's layers, send (or apply the head)."""

    def __init__(self, shard: Shard, model: DecoderLM):
        self.shard, self.model = shard, model
        self.dtype = next(model.parameters()).dtype

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttnBatch) -> torch.Tensor | None:
        s, m, cfg = self.shard, self.model, self.shard.config
        if cfg.position == "rope":
            batch.rope = rope_tables(cfg, positions, self.dtype)
        if s.first:
            x = m.embed(ids, positions)
        else:
            x = torch.empty(ids.shape[0], cfg.hidden_size, dtype=self.dtype, device=ids.device)
            dist.recv(x, src=s.rank - s.dims.tp)
        for layer in m.layers:
            x = layer(x, batch)
        if s.last:
            return m.head(x.index_select(0, batch.last))
        dist.send(x.contiguous(), dst=s.rank + s.dims.tp)
        return None
