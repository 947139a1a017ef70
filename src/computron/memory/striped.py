"""Striped swap-in: a model that lives on one GPU pulls its weights through several GPUs' host links.

What flows where: the model's pinned host image (host memory) into its region of the arena on its
own GPU. Each layer group of the image is cut into chunks and the chunks are dealt to the links in
turn (``deal``). The model's own GPU copies its chunks host -> region on its copy stream, as
``ImageSwapper`` does. A helper GPU copies each of its chunks host -> a staging slot in its own memory
(over its own host link), then pushes the slot into the region over NVLink (a peer copy) while the
next chunk lands in its other slot. One event per layer group on the model's GPU fires when every
link's chunks of that group are in, so compute on layer *i* still waits for layer *i* alone.

Staging: a helper holds ``slots`` x ``chunk`` bytes while a swap uses it: mapped (CUDA virtual
memory) when the swap starts, returned to the driver as soon as its last peer copy ends (a thread
waits for that), so the memory is borrowed only while copying. Without virtual memory management
the slots are a plain allocation dropped at the same moment. On the CPU every copy is synchronous
and the helpers' staging is host memory: the same deal runs in tests, byte for byte.
"""

from __future__ import annotations

import threading
import time

import torch

from .arena import Arena, Region
from .host import HostImage
from .swapper import ImageSwapper, SwapIn
from .units import STRIPE_CHUNK as CHUNK


def deal(groups: tuple[tuple[int, int], ...] | list[tuple[int, int]], links: int,
         chunk: int = CHUNK) -> list[list[tuple[int, int, int]]]:
    """Per layer group, its chunks as (link, start, end): the group's bytes cut at ``chunk``
    boundaries and dealt to links 0 (the model's own GPU), 1, ..., ``links`` - 1 in turn, the turn
    carried from one group to the next so that small groups do not all land on one link."""
    if links < 1 or chunk < 1:
        raise ValueError(f"need at least one link and a positive chunk, got {links} links of {chunk} bytes")
    out, turn = [], 0
    for lo, hi in groups:
        parts = []
        for a in range(lo, hi, chunk):
            parts.append((turn % links, a, min(a + chunk, hi)))
            turn += 1
        out.append(parts)
    return out


class _Helper:
    """A helper GPU: its streams, its staging slots (borrowed while a swap uses them)."""

    def __init__(self, device: torch.device, home: torch.device, chunk: int, slots: int):
        self.device, self.chunk, self.slots = device, chunk, slots
        self.nbytes = chunk * slots
        self._lock = threading.Lock()
        self._users = 0
        self._vmm = None
        self.staging: torch.Tensor | None = None
        self.next_slot = 0
        if device.type != "cuda":
            return
        from .vmm import reserve

        self.h2d = torch.cuda.Stream(device)  # host -> staging, over the helper's own link
        self.push = torch.cuda.Stream(device)  # staging -> the model's region, over NVLink
        self.recv = torch.cuda.Stream(home)  # the model's GPU's side of the pushes (PyTorch's cross-device barrier)
        self.landed = [torch.cuda.Event() for _ in range(slots)]
        self.free = [torch.cuda.Event() for _ in range(slots)]
        self._vmm = reserve(device, self.nbytes)
        if self._vmm is not None:
            self._vmm.map_to(0)

    def acquire(self) -> torch.Tensor:
        """The staging slots, mapped for one more swap."""
        with self._lock:
            if self._users == 0:
                if self._vmm is not None:
                    self._vmm.map_to(self.nbytes)
                    self.staging = self._vmm.tensor[: self.nbytes]
                else:
                    self.staging = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            self._users += 1
            return self.staging

    def release(self) -> None:
        """One swap is done with the slots: the last one out returns them."""
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self.staging = None
                if self._vmm is not None:
                    self._vmm.map_to(0)

    @property
    def borrowed(self) -> int:
        """Bytes of this helper's memory held now."""
        with self._lock:
            return self.nbytes if self._users else 0


class StripedSwapper(ImageSwapper):
    """``ImageSwapper`` whose swap-ins also pull through the host links of ``helpers`` (other GPUs)."""

    def __init__(self, arena: Arena, helpers: list[torch.device], chunk: int = CHUNK, slots: int = 2):
        super().__init__(arena)
        if slots < 2:
            raise ValueError("a helper needs two staging slots at least (one lands while the other is pushed)")
        self.chunk = chunk
        self.helpers = [_Helper(torch.device(h), self.device, chunk, slots) for h in helpers]
        if self.device.type == "cuda":
            self.join = torch.cuda.Stream(self.device)  # where each group's links meet
            for h in self.helpers:
                arena.grant(h.device)

    def borrowed(self) -> dict[str, int]:
        """Staging bytes held on each helper now (zero between swaps)."""
        return {str(h.device): h.borrowed for h in self.helpers}

    def swap_in(self, name: str, image: HostImage) -> tuple[Region, SwapIn]:
        if not self.helpers:
            return super().swap_in(name, image)
        region = self.arena.allocate(image.nbytes, "weights", name)
        plan = deal(image.layout.groups, 1 + len(self.helpers), self.chunk)
        if self.copy_stream is None:
            return region, self._copy_sync(region.tensor, image.buffer, plan)
        return region, self._copy_async(region.tensor, image.buffer, plan)

    def _copy_sync(self, dst: torch.Tensor, src: torch.Tensor, plan) -> SwapIn:
        t0 = time.perf_counter()
        staging = [h.acquire() for h in self.helpers]
        try:
            for parts in plan:
                for link, lo, hi in parts:
                    if link == 0:
                        dst[lo:hi].copy_(src[lo:hi])
                    else:
                        slot = staging[link - 1][: hi - lo]
                        slot.copy_(src[lo:hi])
                        dst[lo:hi].copy_(slot)
        finally:
            for h in self.helpers:
                h.release()
        return SwapIn(wall_s=time.perf_counter() - t0)

    def _copy_async(self, dst: torch.Tensor, src: torch.Tensor, plan) -> SwapIn:
        compute = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(compute)  # no copy may overtake compute still reading reused memory
        start = torch.cuda.Event(enable_timing=True)
        start.record(self.copy_stream)
        staging = []
        for h in self.helpers:
            staging.append(h.acquire())
            h.recv.wait_stream(compute)
            h.h2d.wait_event(start)
        events = []
        # per link, the event after its last bytes, recorded then: one recorded after the loop on a stream
        # that had gone idle would carry the host's later time
        ends = [start] * (1 + len(self.helpers))
        for parts in plan:
            own_done = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.copy_stream):
                for link, lo, hi in parts:
                    if link == 0:
                        dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
            own_done.record(self.copy_stream)
            self.join.wait_event(own_done)
            if any(link == 0 for link, _, _ in parts):
                ends[0] = own_done
            for i, h in enumerate(self.helpers):
                mine = [(lo, hi) for link, lo, hi in parts if link == i + 1]
                for lo, hi in mine:
                    self._relay(h, staging[i], dst, src, lo, hi)
                if mine:
                    done = torch.cuda.Event(enable_timing=True)
                    done.record(h.recv)  # on the model's GPU: the barrier after each push made recv wait for it
                    self.join.wait_event(done)
                    ends[i + 1] = done
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.join)
            events.append(ev)
        for h in self.helpers:
            last = torch.cuda.Event()
            last.record(h.push)
            threading.Thread(target=self._give_back, args=(h, last), daemon=True).start()
        return SwapIn(events, start, link_ends=ends)

    @staticmethod
    def _relay(h: _Helper, staging: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
        """One chunk through helper ``h``: host -> a staging slot, then the slot -> the region."""
        s = h.next_slot
        h.next_slot = (s + 1) % h.slots
        slot = staging[s * h.chunk : s * h.chunk + (hi - lo)]
        h.h2d.wait_event(h.free[s])  # the slot's previous push is done (never recorded: no wait)
        with torch.cuda.stream(h.h2d):
            slot.copy_(src[lo:hi], non_blocking=True)
        h.landed[s].record(h.h2d)
        h.push.wait_event(h.landed[s])
        # PyTorch runs a cross-device copy on the source device's current stream, fenced both ways
        # with the destination device's current stream: push and recv here.
        with torch.cuda.stream(h.push), torch.cuda.stream(h.recv):
            dst[lo:hi].copy_(slot, non_blocking=True)
        h.free[s].record(h.push)

    @staticmethod
    def _give_back(h: _Helper, last) -> None:
        with torch.cuda.device(h.device):  # the helper's context current on this thread for the unmap
            last.synchronize()
            h.release()
