"""The collectives of a TP x PP model, applied from outside the model code.

What flows through: each rank (one process, one device) runs its ``ModelRunner`` on the same
step input (token ids, positions, the ``AttnBatch`` of its own KV cache). Within a stage the
tensor ranks are joined by a process group (``tp_group``); :func:`install_tp_hooks` sets the
model's hooks to an all-reduce after the row-parallel ``o``/``down`` projections and after the
vocab-parallel embedding, and to an all-gather of the vocab-parallel logits. Between stages the
hidden states ``[N, hidden]`` go point to point: tensor rank *t* of stage *s* sends to tensor rank
*t* of stage *s+1* (every tensor rank holds the same, reduced activations). The last stage returns
the logits of each sequence's last token; earlier stages return None. With tp = pp = 1 nothing
here touches ``torch.distributed``.

Training (``grads=True``) uses the reduce as an autograd function and no gather: the loss is taken
on each rank's vocabulary range (``train/job.py``'s ``SoftmaxCrossEntropy`` with the group: the row
maxima, the denominators and the targets' logits are all-reduced, the logits never gathered). Every
tensor rank computes the same replicated activations (residual stream, norms); in the backward
each rank carries only its own part of their gradient (through its heads, its MLP columns, its
vocabulary range), and the parts add up to the true gradient. So the reduce after a row-parallel
projection sums in both directions (forward: the partial outputs; backward: the partial gradients,
which the sharded weights before it need whole), and the gradients of the replicated parameters
(norms, learned positions) are summed over the group once per step by the trainer. This is Megatron's identity/all-reduce
pair with the backward all-reduce moved from the column-parallel input to the row-parallel
output, which needs no hook inside the layers; it moves the same bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.transformer import DecoderLM
from .dims import ParallelDims
from .sharding import Shard


def tp_group(dims: ParallelDims, rank: int, ranks: list[int] | None = None):
    """The tensor-parallel group of ``rank``'s stage. ``ranks[i]``: the process (global rank) of the
    placement's rank *i* (default: the same numbers). Every process of the world must call this,
    for every placement, in the same order: creating a group is collective."""
    ranks = list(range(dims.world_size)) if ranks is None else list(ranks)
    mine = None
    for stage in range(dims.pp):
        members = ranks[stage * dims.tp:(stage + 1) * dims.tp]
        group = dist.new_group(ranks=members)
        if rank in range(stage * dims.tp, (stage + 1) * dims.tp):
            mine = group
    return mine


class StageLinks:
    """Point-to-point links of one rank to the same tensor rank of the previous and next stages."""

    def __init__(self, shard: Shard, ranks: list[int] | None = None):
        ranks = list(range(shard.dims.world_size)) if ranks is None else list(ranks)
        tp = shard.dims.tp
        self.prev = None if shard.first else ranks[shard.rank - tp]
        self.next = None if shard.last else ranks[shard.rank + tp]

    def recv(self, rows: int, hidden: int, dtype: torch.dtype, device) -> torch.Tensor:
        x = torch.empty(rows, hidden, dtype=dtype, device=device)
        dist.recv(x, src=self.prev)
        return x

    def send(self, x: torch.Tensor) -> None:
        dist.send(x.contiguous(), dst=self.next)


class _SumBothWays(torch.autograd.Function):
    """All-reduce in the forward and in the backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        # in place: x is a fresh projection output (or the masked embedding) that nothing saved for the
        # backward, so summing into it spares a copy a collective
        ctx.group = group
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()  # the incoming gradient may be shared (the residual branch holds it too)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def tp_reduce(group):
    """The training reduce over ``group``: an all-reduce of its input forward and of its gradient
    backward (:class:`_SumBothWays`), what the trainer sets on every layer's ``attn`` and ``mlp``."""
    return lambda x: _SumBothWays.apply(x, group)


def install_tp_hooks(model: DecoderLM, shard: Shard, group, grads: bool = False) -> None:
    """Set the model's reduce/gather hooks to collectives over ``group`` (nothing when tp = 1);
    ``grads``: collectives that carry gradients (training)."""
    tp, vocab = shard.dims.tp, shard.full.vocab_size
    if tp == 1:
        return
    if grads:
        model.reduce = tp_reduce(group) if shard.first else None
        model.gather = None  # the loss is taken on each rank's vocabulary range (train/job.py SoftmaxCrossEntropy)
        for layer in model.layers:
            layer.attn.reduce = layer.mlp.reduce = tp_reduce(group)
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
