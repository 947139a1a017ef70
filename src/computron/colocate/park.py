"""A paused training job's state, parked in pinned host memory and brought back in chunks.

When inference needs more memory than the smallest micro-batch leaves, a colocated job pauses:
its weights, gradients, optimizer state and buffers leave the GPU. :class:`Parking` moves them
through page-locked host buffers, allocated once and reused by every pause (page-locked copies run
at the link's speed; pageable ones at a fraction of it, and ``Tensor.to("cpu")`` allocates a new
host tensor each time). Page-locking takes far longer than the copy: on an H200 host the first
pause of a GPT-2-medium job took 3.8-4.4 s, the later ones 0.1-0.16 s (bench/results
hybrid_h200_s39, handover_h200_s41, task-switch). So :meth:`Parking.reserve` allocates them ahead,
from another thread while the job trains (``computron train`` does after its first step); a pause
that comes first waits for it. While paused, each tensor's
``.data`` is its host buffer, so the state stays readable (a checkpoint can be written).

Resuming copies the buffers back in chunks of ``chunk_bytes`` and asks ``stop()`` between chunks:
an order that needs the memory again (a new burst of inference) stops the resume at once. The
GPU copies made so far are dropped, and the state is still whole in the host buffers (nothing
trained meanwhile), so stopping costs nothing and nothing moves out again.

Which tensors: ``slots()`` lists them as (holder, key) pairs, re-listed at each pause since an
optimizer's state appears at its first step and gradients come and go; :func:`training_slots`
gives those of a module and an optimizer. Works on CPU too (parking then only swaps in a copy).
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

import torch

Slot = tuple[object, str]  # (a tensor's holder, the attribute or key): a Parameter's "data"/"grad", a dict's key


def _get(slot: Slot) -> torch.Tensor | None:
    holder, key = slot
    return holder.get(key) if isinstance(holder, dict) else getattr(holder, key)


def _set(slot: Slot, t: torch.Tensor) -> None:
    holder, key = slot
    if isinstance(holder, dict):
        holder[key] = t
    elif key == "data":
        holder.data = t
    else:
        setattr(holder, key, t)


def training_slots(params: Iterable[torch.Tensor], opt: torch.optim.Optimizer | None = None,
                   buffers: Iterable[torch.Tensor] = ()) -> list[Slot]:
    """Every tensor of a training state: each parameter's data and gradient, its optimizer state
    (not a fused optimizer's step counters, which are a few bytes and stay put), and ``buffers``."""
    out: list[Slot] = []
    for p in params:
        out.append((p, "data"))
        if p.grad is not None:
            out.append((p, "grad"))
        if opt is not None:
            st = opt.state.get(p, {})
            out += [(st, k) for k, v in st.items() if torch.is_tensor(v) and k != "step"]
    out += [(b, "data") for b in buffers]
    return out


class Parking:
    def __init__(self, slots: Callable[[], list[Slot]], device: torch.device | str,
                 chunk_bytes: int = 256 << 20):
        self.slots, self.device, self.chunk_bytes = slots, torch.device(device), chunk_bytes
        self.pin = self.device.type == "cuda"
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # (id of holder, key) -> its host buffer
        self._parked: list[tuple[Slot, torch.Tensor]] = []
        self._lock = threading.Lock()  # the host buffers are made by one thread at a time (reserve, park)
        self.stopped = 0  # resumes stopped by an order
        self.parked_bytes = 0
        self.reserved_bytes = 0  # host buffers allocated by reserve()

    @property
    def parked(self) -> bool:
        return bool(self._parked)

    def _buffer(self, slot: Slot, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The slot's host buffer for ``t``, and whether it was made now."""
        key = (id(slot[0]), slot[1])
        buf = self._host.get(key)
        if buf is not None and buf.shape == t.shape and buf.dtype == t.dtype and buf.stride() == t.stride():
            return buf, False
        buf = self._host[key] = torch.empty_like(t, device="cpu", pin_memory=self.pin)  # strides kept
        return buf, True

    def _on_device(self) -> list[tuple[Slot, torch.Tensor]]:
        out = []
        for slot in self.slots():
            t = _get(slot)
            if t is None or t.device.type == "cpu" and self.device.type != "cpu":
                continue
            out.append((slot, t))
        return out

    def reserve(self) -> int:
        """Allocate the host buffer of every slot's tensor now, copying nothing, so that a pause only
        copies; safe beside the training loop (only shapes are read). Bytes allocated."""
        made = 0
        with self._lock:
            for slot, t in self._on_device():
                buf, new = self._buffer(slot, t)
                made += buf.numel() * buf.element_size() if new else 0
        self.reserved_bytes += made
        return made

    def park(self) -> int:
        """Copy every slot's tensor into its host buffer and point the slot at it; the GPU copies are
        freed once nothing refers to them (the caller releases the allocator's cache). Bytes moved."""
        if self._parked:
            return 0
        moved = []
        with self._lock:  # a reserve() under way finishes first
            for slot, t in self._on_device():
                buf, _ = self._buffer(slot, t)
                buf.copy_(t.detach(), non_blocking=self.pin)
                moved.append((slot, buf))
        if self.pin:
            torch.cuda.synchronize(self.device)
        for slot, buf in moved:
            _set(slot, buf)
        self._parked = moved
        self.parked_bytes = sum(b.numel() * b.element_size() for _, b in moved)
        return self.parked_bytes

    def unpark(self, stop: Callable[[], bool] = lambda: False) -> bool:
        """Copy the parked state back to the device, asking ``stop()`` after each chunk; True when it
        is back, False when ``stop()`` said so (the state then stays whole on the host)."""
        out, pending = [], 0
        stream = torch.cuda.current_stream(self.device) if self.pin else None
        for slot, buf in self._parked:
            t = torch.empty_like(buf, device=self.device)
            t.copy_(buf, non_blocking=self.pin)
            out.append(t)
            pending += buf.numel() * buf.element_size()
            if pending >= self.chunk_bytes:
                pending = 0
                if stream is not None:
                    stream.synchronize()
                if stop():
                    self.stopped += 1
                    return False
        if stream is not None:
            stream.synchronize()
        if stop():  # the last chunk's order: the copies are dropped as above
            self.stopped += 1
            return False
        for (slot, _), t in zip(self._parked, out):
            _set(slot, t)
        self._parked = []
        return True
