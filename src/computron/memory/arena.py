"""Arena: the device memory budget as one buffer, handed out in tagged, byte-accounted regions.

Lives on the serving device (GPU, or the CPU when there is none). Weights and KV-cache blocks
are regions of it; PyTorch's own allocator only sees the workspace of a forward pass. Regions
are placed first-fit at aligned offsets: the lowest hole that holds them. The holes between regions
are kept (sorted by offset) beside the regions, and the bytes in use as counters, so that a KV
block (the smallest region: any hole holds one) takes the first hole at once and a release finds
its neighbours by bisection, with thousands of blocks live. When the free bytes suffice but no hole is large
enough, the arena compacts: live regions slide down (device-to-device copies, in stream order)
and their owners see a new ``version`` and re-take their views. So an allocation fails only when
the bytes do not fit, never for fragmentation.

The arena can shrink and grow at run time (``resize``: colocation hands memory to a training job
and takes it back). On a GPU its buffer is a fixed virtual range (``memory/vmm.py``) whose
physical memory past the arena's end is returned to the driver, so what is released is really
free for others; shrinking below a live region first compacts. On the CPU, or where the driver
offers no virtual memory management, the buffer keeps its whole size and only the accounting moves.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import torch

from .units import align_up


class OutOfMemory(RuntimeError):
    pass


@dataclass(eq=False)
class Region:
    offset: int
    nbytes: int
    tag: str  # "weights" | "kv" | "staging"
    owner: str
    version: int = 0  # bumped each time compaction moves the region
    arena: "Arena | None" = None

    @property
    def tensor(self) -> torch.Tensor:
        """The region as a flat uint8 tensor (re-take after a move: compare ``version``)."""
        return self.arena.buffer[self.offset : self.offset + self.nbytes]


class Arena:
    def __init__(self, nbytes: int, device: torch.device | str):
        """``nbytes``: the most it will ever hold (``resize`` moves its end below that)."""
        self.device = torch.device(device)
        self.nbytes = self.max_bytes = nbytes
        self._vmm = None
        if self.device.type == "cuda":
            from .vmm import reserve

            self._vmm = reserve(self.device, nbytes)
        if self._vmm is not None:
            self._vmm.map_to(nbytes)
            self.buffer = self._vmm.tensor
        else:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._regions: list[Region] = []  # sorted by offset
        self._offsets: list[int] = []  # their offsets, for bisection
        self._holes: list[list[int]] = []  # [offset, bytes] of each gap between regions, sorted (not the tail)
        self._used: dict[str, int] = {}  # bytes in use by tag
        self.compactions = 0
        # Asked when bytes do not fit, before failing: its owner frees what it can without waiting on
        # the scheduler (staging a striped swap-in still holds until its sends end), True if it did.
        self.reclaim: Callable[[], bool] | None = None

    @property
    def backed(self) -> int:
        """Bytes of device memory the arena holds now (its end, rounded up to the driver's chunks;
        the whole buffer where memory cannot be returned)."""
        return self._vmm.mapped if self._vmm is not None else self.buffer.numel()

    def resize(self, nbytes: int) -> int:
        """Move the arena's end to ``nbytes`` (at most the size it was made with; at least what its
        regions hold, compacted) and return the new end. Shrinking returns the memory past the end
        to the device; regions beyond it move down first (compaction: owners see a new version)."""
        end = min(max(nbytes, self.used()), self.max_bytes)
        if end > self.nbytes:  # the memory is mapped before any allocation may use it (a failure changes nothing)
            if self._vmm is not None:
                self._vmm.map_to(end)
            self.nbytes = end
            return end
        if self._regions and self._regions[-1].offset + self._regions[-1].nbytes > end:
            self._compact()
        self.nbytes = end
        if self._vmm is not None:
            self._vmm.map_to(end)
        return end

    def grant(self, peer: torch.device) -> None:
        """Let GPU ``peer`` write into the arena (a striped swap's peer copies). A plain allocation
        needs nothing here: PyTorch enables peer access between the two devices at the first copy."""
        if self._vmm is not None:
            self._vmm.grant(peer)

    def used(self, tag: str | None = None) -> int:
        return sum(self._used.values()) if tag is None else self._used.get(tag, 0)

    @property
    def free(self) -> int:
        return self.nbytes - self.used()

    def regions(self) -> list[Region]:
        return list(self._regions)

    def allocate(self, nbytes: int, tag: str, owner: str) -> Region:
        size = align_up(max(nbytes, 1))
        if size > self.free and self.reclaim is not None:
            self.reclaim()
        if size > self.free:
            raise OutOfMemory(
                f"{owner}: {size} bytes of {tag} do not fit: {self.free} of {self.nbytes} bytes free")
        offset = self._first_fit(size)
        if offset is None:
            self._compact()
            offset = self._first_fit(size)
            assert offset is not None, "compaction left no hole for bytes that fit"
        region = Region(offset, size, tag, owner, arena=self)
        i = bisect.bisect_left(self._offsets, offset)
        self._regions.insert(i, region)
        self._offsets.insert(i, offset)
        self._used[tag] = self._used.get(tag, 0) + size
        return region

    def release(self, region: Region) -> None:
        i = bisect.bisect_left(self._offsets, region.offset)
        if i == len(self._regions) or self._regions[i] is not region:
            raise ValueError(f"{region.owner}: this region is not in the arena")
        del self._regions[i], self._offsets[i]
        self._used[region.tag] -= region.nbytes
        region.arena = None
        lo = self._regions[i - 1].offset + self._regions[i - 1].nbytes if i else 0
        if i == len(self._regions):  # it was the last region: its bytes and the hole before it join the tail
            if self._holes and self._holes[-1][0] == lo:
                self._holes.pop()
            return
        hi = self._regions[i].offset  # the hole from the previous region's end to the next one's start
        j = bisect.bisect_left(self._holes, [lo])
        if j < len(self._holes) and self._holes[j][0] == lo:  # merge with the hole before it ...
            del self._holes[j]
        if j < len(self._holes) and self._holes[j][0] < hi:  # ... and the one after it
            del self._holes[j]
        self._holes.insert(j, [lo, hi - lo])

    def _first_fit(self, size: int) -> int | None:
        """The lowest offset with ``size`` bytes free (the hole it came from shrinks), or None."""
        holes = self._holes
        for j, h in enumerate(holes):
            if h[1] >= size:
                at = h[0]
                if h[1] == size:
                    del holes[j]
                else:
                    h[0] += size
                    h[1] -= size
                return at
        end = self._regions[-1].offset + self._regions[-1].nbytes if self._regions else 0
        return end if self.nbytes - end >= size else None

    def _compact(self) -> None:
        """Slide every region down to close the holes, copying in chunks no larger than the gap
        (so a chunk's source and destination never overlap)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no copy or kernel may still touch a region that moves
        cursor = 0
        for r in self._regions:
            if r.offset > cursor:
                gap = r.offset - cursor
                for pos in range(0, r.nbytes, gap):
                    n = min(gap, r.nbytes - pos)
                    self.buffer[cursor + pos : cursor + pos + n].copy_(self.buffer[r.offset + pos : r.offset + pos + n])
                r.offset = cursor
                r.version += 1
            cursor = r.offset + r.nbytes
        self._offsets = [r.offset for r in self._regions]
        self._holes = []
        self.compactions += 1
