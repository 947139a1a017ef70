"""CUDA graphs of a pipeline stage: each micro-batch's forward and backward replayed, the pipeline's
point-to-point transfers left to the schedule, outside the graphs.

A pipeline step runs many small kernels per micro-batch and stage, and between them the schedule's
host work; on small models the host sets the pace (the eager pipelines' timings moved by up to 91%
between runs of one lease). ``GraphedStage`` wraps a stage's module so that its forward and its
backward are each one graph replay (``torch.cuda.make_graphed_callables``), while torch's pipeline
schedule keeps calling it, sending its outputs and receiving its gradients as before.

A graph's activations live in its own memory: a forward of the next micro-batch before the backward
of this one (1F1B: f0 f1 b0 f2 b1 ...) would overwrite them in a graph shared by both. So a stage keeps
one graph per micro-batch in flight (a *slot*), each captured on its first use with its own memory
pool (a pool shared by graphs must see them run in the order of capture, and 1F1B's order is not
that), and a micro-batch takes a free slot at its forward and gives it back when its backward starts.
What leaves a slot is copied out of it (the output the schedule sends or feeds the loss, and the
gradient of the input it sends back): the next replay of that slot overwrites its buffers, and a
transfer of the schedule may still be reading them. The parameters' gradients never leave the graph:
the backward graph adds them into float32 accumulators, as the graphed step without a pipeline does, so
autograd sees each stage as one operation and runs no per-parameter work (an accumulation and its hook
for each parameter cost the host more than a small micro-batch's whole backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..planner.profile import side_stream


def pool_bytes(device: torch.device, pool) -> int:
    """Bytes the caching allocator holds in the private memory pool ``pool`` of ``device`` (the
    segments a CUDA graph capture allocated there) beyond the tensors alive in it (a graph's static
    output, which the allocator counts as allocated already): the room its replays use unseen."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sum(seg["total_size"] - seg["allocated_size"] for seg in torch.cuda.memory_snapshot()
               if seg["device"] == index and tuple(seg["segment_pool_id"]) == tuple(pool))


@dataclass
class _Slot:
    """One micro-batch's graphs and their static buffers."""
    index: int
    fwd: torch.cuda.CUDAGraph
    bwd: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    out: torch.Tensor
    grad_out: torch.Tensor
    grad_in: list[torch.Tensor | None]


class _Replay(torch.autograd.Function):
    """A slot's forward graph, its backward graph in the backward; what leaves the slot is a copy."""

    @staticmethod
    def forward(ctx, slot: _Slot, free: list[int], anchor: torch.Tensor, *args: torch.Tensor):
        for static, a in zip(slot.inputs, args):
            static.copy_(a)
        slot.fwd.replay()
        ctx.slot, ctx.free = slot, free
        return slot.out.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        slot = ctx.slot
        slot.grad_out.copy_(grad)
        slot.bwd.replay()
        ctx.free.append(slot.index)  # the slot's next forward may overwrite it now: its gradients are copied
        return (None, None, None, *(g.clone() if g is not None else None for g in slot.grad_in))


class GraphedStage(nn.Module):
    """``module`` with its forward and backward replayed from CUDA graphs, ``slots`` micro-batches
    in flight at most (1F1B on stage s of p: p - s; per chunk of an interleaved schedule,
    ``planner/schedule.chunk_peaks``). The parameters' gradients are added into ``grads`` (one
    tensor per parameter of ``module``, in its order, of any float type: the trainer's float32
    accumulators), inside the backward graph; autograd sees the stage as one operation of its inputs.

    Every call in grad mode must have the shapes of the first (a pipeline runs equal micro-batches); a
    call with no slot free is an error that says how many were in flight. Under ``torch.no_grad`` the
    stage runs eager (torch's pipeline infers its shapes so, with inputs that need no gradient)."""

    def __init__(self, module: nn.Module, slots: int, grads: list[torch.Tensor]):
        super().__init__()
        if slots < 1:
            raise ValueError(f"a graphed stage needs at least one slot, got {slots}")
        self.module = module
        self.params = [p for p in module.parameters()]
        if len(grads) != len(self.params) or any(g.shape != p.shape for g, p in zip(grads, self.params)):
            raise ValueError(f"a graphed stage needs one gradient accumulator per parameter, of its shape: "
                             f"{len(self.params)} parameters, {len(grads)} accumulators")
        self.grads = grads
        self.slots: list[_Slot | None] = [None] * slots
        self.free = list(range(slots - 1, -1, -1))  # the lowest slot first
        self.shapes: tuple | None = None
        self.captures = 0
        self.pool_bytes = 0  # what the slots' private pools hold (a replay allocates nothing)
        self._anchor: torch.Tensor | None = None  # makes the output need a gradient when no input does

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation, torch's metadata inference: no backward comes, run eager
            return self.module(*args)
        shapes = tuple((a.shape, a.dtype, a.requires_grad) for a in args)
        if self.shapes is None:
            self.shapes = shapes
        elif shapes != self.shapes:
            raise ValueError(f"a graphed stage runs micro-batches of one shape: captured {self.shapes}, got {shapes}")
        if not self.free:
            raise RuntimeError(f"a graphed stage's {len(self.slots)} slots are all in flight: the schedule runs "
                               "more micro-batches' forwards ahead of their backwards than it was given slots for")
        i = self.free.pop()
        slot = self.slots[i]
        if slot is None:
            slot = self.slots[i] = self._capture(i, args)
        if self._anchor is None:
            self._anchor = torch.empty(0, device=args[0].device, requires_grad=True)
        return _Replay.apply(slot, self.free, self._anchor, *args)

    def _capture(self, index: int, args: tuple[torch.Tensor, ...]) -> _Slot:
        """A slot's graphs: two eager runs on a side stream first (libraries allocate their workspaces
        on a first call, which a capture must not see; their gradients are dropped), then the forward
        and the backward captured into a pool of the slot's own (see the module's docstring). Every
        rank of a tensor-parallel group captures at the same micro-batch, so the collectives inside match."""
        device = args[0].device
        inputs = [torch.zeros_like(a).requires_grad_(a.requires_grad) for a in args]
        want = [x for x in inputs if x.requires_grad] + self.params
        here, side = torch.cuda.current_stream(device), side_stream(device)
        side.wait_stream(here)
        with torch.cuda.stream(side):
            for _ in range(2):
                out = self.module(*inputs)
                torch.autograd.grad(out, want, torch.zeros_like(out), allow_unused=True)
        here.wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(fwd, pool=pool, capture_error_mode="thread_local"):
            out = self.module(*inputs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"a graphed stage's module must return one tensor, got {type(out).__name__}")
        grad_out = torch.zeros_like(out)
        with torch.cuda.graph(bwd, pool=pool, capture_error_mode="thread_local"):
            grads = torch.autograd.grad(out, want, grad_out, allow_unused=True)
            n = len(want) - len(self.params)
            made = [(acc, g) for acc, g in zip(self.grads, grads[n:]) if g is not None]
            torch._foreach_add_([acc for acc, _ in made], [g for _, g in made])
            it = iter(grads[:n])
            grad_in = [next(it) if x.requires_grad else None for x in inputs]
        del grads, made
        self.captures += 1
        self.pool_bytes += pool_bytes(device, pool)
        return _Slot(index, fwd, bwd, inputs, out.detach(), grad_out, grad_in)

    def reset(self) -> None:
        """Let go of the graphs (before the process group goes: a graph that captured collectives keeps it)."""
        for slot in self.slots:
            if slot is not None:
                slot.fwd.reset()
                slot.bwd.reset()
        self.slots = [None] * len(self.slots)
        self.free = list(range(len(self.slots) - 1, -1, -1))
        self.shapes = None
        self.pool_bytes = 0
