"""Swapping weights between host memory and the device.

``ImageSwapper`` (the default): the model's pinned host image is copied into one arena region
with a few large asynchronous copies on a dedicated copy stream, one per layer group, each
followed by an event. ``SwapIn.wait(i)`` makes the compute stream wait for group *i* only, so a
cold request computes layer 0 while later layers are still in flight. Swap-out releases the
region and copies nothing.

``LegacySwapper`` reproduces the original Computron for comparison: per-parameter ``.to()``
copies on a load stream, the whole load finished before compute, and on eviction every weight
copied back to the host on an offload stream (PyTorch's asynchronous device-to-host copy lands
in pinned memory, so host copies are pinned from the first eviction on).

On the CPU both degrade to plain synchronous copies so the whole path runs in tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .arena import Arena, Region
from .host import HostImage


@dataclass
class SwapIn:
    """An in-flight swap-in: per-group events (None on the CPU, where copies are synchronous)."""

    events: list | None = None
    start: object = None  # CUDA event recorded before the first copy
    wall_s: float = 0.0  # synchronous swaps (CPU, legacy): measured wall time
    link_ends: list | None = None  # striped swaps: per link (own first, then each helper's), when its last bytes landed

    def wait(self, group: int) -> None:
        if self.events is not None:
            torch.cuda.current_stream().wait_event(self.events[group])

    def done(self) -> bool:
        return self.events is None or self.events[-1].query()

    def seconds(self) -> float:
        """Copy time from first to last byte (call once it is done)."""
        if self.events is None or self.start is None:
            return self.wall_s
        self.events[-1].synchronize()
        return self.start.elapsed_time(self.events[-1]) / 1e3


class ImageSwapper:
    def __init__(self, arena: Arena):
        self.arena = arena
        self.device = arena.device
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def swap_in(self, name: str, image: HostImage) -> tuple[Region, SwapIn]:
        region = self.arena.allocate(image.nbytes, "weights", name)
        dst, src = region.tensor, image.buffer
        if self.copy_stream is None:
            t0 = time.perf_counter()
            dst.copy_(src)
            return region, SwapIn(wall_s=time.perf_counter() - t0)
        # Copies must not overtake compute still reading memory this region reuses.
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        start = torch.cuda.Event(enable_timing=True)
        events = []
        with torch.cuda.stream(self.copy_stream):
            start.record()
            for lo, hi in image.layout.groups:
                dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                events.append(ev)
        return region, SwapIn(events, start)

    def swap_out(self, region: Region) -> None:
        self.arena.release(region)


class LegacySwapper:
    """Per-parameter host tensors and device tensors, as the original Computron kept them."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.load_stream = torch.cuda.Stream(self.device) if cuda else None
        self.offload_stream = torch.cuda.Stream(self.device) if cuda else None

    def swap_in(self, host: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], SwapIn]:
        t0 = time.perf_counter()
        if self.load_stream is None:
            dev = {n: t.clone() for n, t in host.items()}
        else:
            self.load_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.load_stream):
                dev = {n: t.to(self.device, non_blocking=True) for n, t in host.items()}
            self.load_stream.synchronize()  # full load before any compute
        return dev, SwapIn(wall_s=time.perf_counter() - t0)

    def swap_out(self, dev: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy every weight back; returns the new host tensors (pinned after the first eviction)."""
        if self.offload_stream is None:
            return {n: t.clone() for n, t in dev.items()}
        self.offload_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.offload_stream):
            host = {n: t.to("cpu", non_blocking=True) for n, t in dev.items()}
        self.offload_stream.synchronize()
        return host
