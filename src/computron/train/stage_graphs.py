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
transfer of the schedule may still be reading them.
"""

from __future__ import annotations

import torch
from torch import nn


class _CopyGrad(torch.autograd.Function):
    """Identity forward; its backward hands on a copy of the gradient (out of a slot's static buffer)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


class _Slot(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


class GraphedStage(nn.Module):
    """``module`` with its forward and backward replayed from CUDA graphs, ``slots`` micro-batches
    in flight at most (1F1B on stage s of p: p - s; per chunk of an interleaved schedule,
    ``planner/schedule.chunk_peaks``).

    Every call must have the shapes of the first (a pipeline runs equal micro-batches); a call with
    no slot free is an error that says how many were in flight."""

    def __init__(self, module: nn.Module, slots: int):
        super().__init__()
        if slots < 1:
            raise ValueError(f"a graphed stage needs at least one slot, got {slots}")
        self.module = module
        self.graphs: list = [None] * slots
        self.free = list(range(slots - 1, -1, -1))  # the lowest slot first
        self.shapes: tuple | None = None
        self.captures = 0

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        shapes = tuple((a.shape, a.dtype, a.requires_grad) for a in args)
        if self.shapes is None:
            self.shapes = shapes
        elif shapes != self.shapes:
            raise ValueError(f"a graphed stage runs micro-batches of one shape: captured {self.shapes}, got {shapes}")
        if not self.free:
            raise RuntimeError(f"a graphed stage's {len(self.graphs)} slots are all in flight: the schedule runs "
                               "more micro-batches' forwards ahead of their backwards than it was given slots for")
        slot = self.free.pop()
        g = self.graphs[slot]
        if g is None:
            g = self.graphs[slot] = self._capture(args)
        args = tuple(_CopyGrad.apply(a) if a.requires_grad else a for a in args)
        out = g(*args)
        if out.requires_grad:  # the slot is free again once its backward has begun (nothing runs in between)
            out.register_hook(lambda grad, s=slot: self.free.append(s))
        else:  # no backward will come (evaluation): free at once
            self.free.append(slot)
        return out.clone()

    def _capture(self, args: tuple[torch.Tensor, ...]) -> nn.Module:
        sample = tuple(torch.zeros_like(a).requires_grad_(a.requires_grad) for a in args)
        self.captures += 1
        # make_graphed_callables replaces the forward of the module it is given, so each slot gets a
        # module of its own around the shared one (its parameters: the gradients the backward graph
        # makes); each call makes a memory pool of its own (see the module's docstring)
        return torch.cuda.make_graphed_callables(_Slot(self.module), sample, num_warmup_iters=2)

    def reset(self) -> None:
        """Let go of the graphs (before the process group goes: a graph that captured collectives keeps it)."""
        self.graphs = [None] * len(self.graphs)
        self.free = list(range(len(self.graphs) - 1, -1, -1))
        self.shapes = None

