"""Striped swap-in across worker processes: helpers relay chunks of an image over point-to-point sends.

The worker executor's form of ``memory/striped.py``: there one process drives every GPU and a
helper pushes its staging into the model's region with a peer copy; here each GPU is a worker
process of its own, so a helper *sends* its staging to the model's worker over a process group of
the pair (NCCL on GPUs, over NVLink where there is one; gloo on the CPU) and the model's worker
receives straight into its region. No CUDA IPC: each side touches only its own device memory.

What flows where: the model's host image (shared memory, mapped by every worker that helps:
``memory/shared.py``) is dealt in chunks to the links (``striped.deal``: link 0 the model's own,
link i the i-th helper of the plan). The model's worker copies its chunks host -> region on its copy
stream and receives the others, each helper's on a stream of its own; one event per layer group
fires when every link's chunks of it are in, so compute on layer *i* still waits for layer *i* alone
(``LinkedSwapper``). A helper copies each of its chunks host -> a staging slot of its arena and sends
the slot, while the next chunk lands in its other slot (``send_chunks``); its staging is released
once its last send has ended. On the CPU everything is synchronous, byte for byte the same path.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from .arena import Region
from .host import HostImage
from .striped import deal
from .swapper import ImageSwapper, SwapIn
from .units import STRIPE_SLOTS


class LinkedSwapper(ImageSwapper):
    """``ImageSwapper`` whose swap-ins may also receive chunks from helper workers (``links``: for
    each helper, in link order, its global rank and the process group of the pair)."""

    def __init__(self, arena, chunk: int):
        super().__init__(arena)
        self.chunk = chunk
        self._recv: list = []  # the model's GPU's receiving streams, one per helper (made as needed)
        self.join = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def swap_in(self, name: str, image: HostImage, links: tuple = ()) -> tuple[Region, SwapIn]:
        if not links:
            return super().swap_in(name, image)
        region = self.arena.allocate(image.nbytes, "weights", name)
        plan = deal(image.layout.groups, 1 + len(links), self.chunk)
        if self.copy_stream is None:
            return region, _receive_sync(region.tensor, image.buffer, plan, links)
        return region, self._receive_async(region.tensor, image.buffer, plan, links)

    def _receive_async(self, dst: torch.Tensor, src: torch.Tensor, plan, links) -> SwapIn:
        while len(self._recv) < len(links):
            self._recv.append(torch.cuda.Stream(self.device))
        compute = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(compute)  # no byte may land before compute reading reused memory is done
        start = torch.cuda.Event(enable_timing=True)
        start.record(self.copy_stream)
        for s in self._recv[:len(links)]:
            s.wait_event(start)
        events = []
        ends = [start] * (1 + len(links))  # per link, the event after its last bytes (as in striped.py)
        for parts in plan:
            with torch.cuda.stream(self.copy_stream):
                for link, lo, hi in parts:
                    if link == 0:
                        dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
            own = torch.cuda.Event(enable_timing=True)
            own.record(self.copy_stream)
            self.join.wait_event(own)
            if any(link == 0 for link, _, _ in parts):
                ends[0] = own
            for i, (rank, group) in enumerate(links):
                mine = [(lo, hi) for link, lo, hi in parts if link == i + 1]
                if not mine:
                    continue
                with torch.cuda.stream(self._recv[i]):  # NCCL waits for this stream, and it for NCCL
                    for lo, hi in mine:
                        dist.irecv(dst[lo:hi], src=rank, group=group).wait()
                got = torch.cuda.Event(enable_timing=True)
                got.record(self._recv[i])
                self.join.wait_event(got)
                ends[i + 1] = got
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.join)
            events.append(ev)
        return SwapIn(events, start, link_ends=ends)


def _receive_sync(dst: torch.Tensor, src: torch.Tensor, plan, links) -> SwapIn:
    """The CPU's path: every receive posted first (straight into the region), the model's own chunks
    copied meanwhile, then every receive waited for."""
    t0 = time.perf_counter()
    works = [dist.irecv(dst[lo:hi], src=links[link - 1][0], group=links[link - 1][1])
             for parts in plan for link, lo, hi in parts if link]
    for parts in plan:
        for link, lo, hi in parts:
            if link == 0:
                dst[lo:hi].copy_(src[lo:hi])
    for w in works:
        w.wait()
    return SwapIn(wall_s=time.perf_counter() - t0)


def send_chunks(src: torch.Tensor, groups, link: int, links: int, home: int, group, staging: torch.Tensor,
                chunk: int, stream=None):
    """A helper's part of a striped swap-in: its chunks of the image ``src`` (those ``deal`` gives
    link ``link`` of ``links``), each copied into a staging slot (``staging``: ``STRIPE_SLOTS`` chunks of
    this device's memory) and sent to global rank ``home`` over ``group``, a slot reused only once its
    previous send has ended. On a GPU the work is queued on ``stream`` and the event after the last send
    is returned (the staging is free once it fires); on the CPU it has all ended on return (None)."""
    mine = [(lo, hi) for parts in deal(groups, links, chunk) for k, lo, hi in parts if k == link]
    sends: list = [None] * STRIPE_SLOTS
    cuda = staging.is_cuda
    if cuda:
        stream.wait_stream(torch.cuda.current_stream(staging.device))  # the staging may be memory compute just read
    with torch.cuda.stream(stream) if cuda else nullcontext():
        for n, (lo, hi) in enumerate(mine):
            s = n % STRIPE_SLOTS
            if sends[s] is not None:
                sends[s].wait()  # the slot's previous send has ended (on a GPU: the stream waits for it)
            slot = staging[s * chunk: s * chunk + (hi - lo)]
            slot.copy_(src[lo:hi], non_blocking=cuda)
            sends[s] = dist.isend(slot, dst=home, group=group)
        for w in sends:
            if w is not None:
                w.wait()
        if not cuda:
            return None
        end = torch.cuda.Event()
        end.record(stream)
        return end

