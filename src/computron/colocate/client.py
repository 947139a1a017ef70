"""The training side of colocation: one call per micro-batch in any PyTorch loop.

::

    colo = Colocation(address, device=0, memory=MemoryModel(...), on_pause=..., on_resume=...)
    colo.watch(model)                       # lets a handover abandon the running micro-batch
    while samples_left:
        m = colo.micro_batch(most=8)        # the largest that fits the current limit (blocks while paused)
        with colo.step(m) as s:
            loss = forward_backward(samples[:m])
        if s.abandoned:
            continue                        # the same samples again, in a smaller micro-batch
        samples = samples[m:]

A background thread holds the connection to the server (:class:`~.protocol.ArbiterServer`) and
receives limits. A limit that the committed memory already fits is acknowledged at once by that
thread. Otherwise, with ``immediate`` the running micro-batch is abandoned (hooks on the watched
modules raise :class:`Abandoned` in its forward or backward), else it finishes; the loop's next
``micro_batch`` call frees memory (``release(keep)``, down to the limit; on CUDA
``devpool.releaser``: the memory pool trimmed under ``cudaMallocAsync``, else the caching
allocator's ``empty_cache``), picks a micro-batch that fits, and acknowledges. A limit under the smallest
micro-batch pauses training: ``on_pause`` moves its state off the GPU, ``on_resume`` back
(``park.py``: through pinned host buffers; a resume stops when an order needs the memory again).
Without an address, nothing limits the job. Lives in the training process; CPU or GPU.

On a GPU the host queues kernels far ahead of their execution, and freeing memory waits for
everything queued. So the watched modules are also fences: every ``fence_every``-th point (a call in
the forward, a gradient in the backward) records a CUDA event, and the host waits there for the
event recorded ``run_ahead`` points earlier before it queues more. An abandon order is then seen,
and the memory freed, after at most ``run_ahead + fence_every - 1`` points of queued GPU work. A
fence costs the host an event and a wait on the training thread or autograd's; spacing them keeps
that off the points in between.

A ``yield`` order (the server's ``yield_compute``: inference has work) holds the host at the next
watched point, after the work queued ``run_ahead`` points earlier is done, until the order ends (or
an abandon order comes, or the server is gone): inference's kernels then run without training's
between them. The time held is ``yielded_s``.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import traceback
from dataclasses import dataclass

from .memmodel import MemoryModel
from .protocol import Channel, connect

# The most a job tells the server (and ``colocate`` caps it at) exceeds its prediction by this share,
# and is told again only when the prediction leaves that band: the fit moves by a few MB as sizes are
# measured, and a cap at the prediction exactly cut the next micro-batch (16 to 10-11 for the first
# steps of a run on an H200) until the server raised it; 0.5% of a 16 GiB job is 82 MiB.
MOST_SLACK = 0.005


class Abandoned(Exception):
    """Raised inside a micro-batch that a handover abandons; :meth:`Colocation.step` catches it."""


@dataclass
class StepState:
    micro_batch: int
    abandoned: bool = False
    peak_bytes: int | None = None


def _noop() -> None:
    pass


def _keep_noop(keep: int) -> None:
    pass


def cuda_fence(t):
    """A CUDA event recorded on ``t``'s device's current stream (None for a CPU tensor: its work is done)."""
    if not t.is_cuda:
        return None
    import torch

    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


class Colocation:
    def __init__(self, address: str | None = None, device: int = 0, memory: MemoryModel | None = None,
                 on_pause=_noop, on_resume=_noop, release=_keep_noop, measure=None, reconnect_s: float = 0.05,
                 run_ahead: int = 8, fence=None, fence_every: int = 1):
        if run_ahead < 0:
            raise ValueError(f"run_ahead must be >= 0 (0: unbounded), got {run_ahead}")
        if fence_every < 1 or run_ahead and fence_every > run_ahead:
            raise ValueError(f"fence_every must be from 1 to run_ahead ({run_ahead}), got {fence_every}")
        self.address, self.device = address, device
        self.run_ahead = run_ahead  # watched points the host may queue ahead of the GPU; 0: unbounded
        self.fence_every = fence_every  # a fence at every this many watched points
        self._points = 0  # watched points of the running micro-batch
        self.fence = fence or cuda_fence  # tensor -> an event after the work queued so far, or None
        self.memory = memory or MemoryModel(0, 0)
        self.on_pause, self.on_resume, self.release = on_pause, on_resume, release
        self.measure = measure  # (start, stop) -> peak bytes of the micro-batch; None: not measured
        self.reconnect_s = reconnect_s
        self.abandoned = 0
        self.paused_s = self.yielded_s = 0.0
        self._yield = False  # the server asked for the compute: hold at the next watched point
        self._cond = threading.Condition()
        self._limit: int | None = None
        self._limit_id = self._acked_id = 0
        self._received = 0.0
        self._reached: float | None = None  # when the loop reached the newest order's release (None: not yet)
        self._drained: float | None = None  # when the GPU work queued before that release was done
        self._committed = 0  # bytes the job may be using now (its running or last micro-batch)
        self._running = 0
        self._busy = False  # a micro-batch is chosen or running (from micro_batch's return to step's end)
        self._fencing = False  # the host waits at a fence
        self._at = ""  # where the loop was when the newest order came (for the ack)
        self._abandon = self._immediate = False
        self._paused = self._resuming = False
        # the first micro-batch after a resume rebuilds state (the trainer remakes its bf16 weights from
        # the masters): its peak is not the size's, and one such peak kept as the size's largest made the
        # model say no micro-batch fits a limit the job ran in, so a static limit paused the job for good
        self._settling = False
        self.resume_s = 0.0
        self._fences: collections.deque = collections.deque()  # (point, event) of the running micro-batch, oldest first
        self._chan: Channel | None = None
        self._closed = False
        self._min_bytes = self.memory.predict(1)
        self._max_bytes = 0  # the most the job can use, as last told to the server (0: not yet known)
        if address is not None:
            self._thread = threading.Thread(target=self._receive, daemon=True)
            self._thread.start()

    # ---- what the training loop calls ------------------------------------------------------

    def wait_connected(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._chan is not None and self._limit is not None, timeout)

    def micro_batch(self, most: int) -> int:
        """The largest micro-batch (<= ``most``) that fits the current limit; blocks while none does.

        Pausing and resuming (``on_pause``, ``on_resume``) run outside the lock that delivering an
        order takes, so an order is acknowledged while the state moves whenever the memory it asks
        for is already free, and an order that needs the memory back stops a resume in progress
        (``resume_stopped``; ``on_resume`` returns False when it stopped)."""
        self._tell_most(most)
        while True:
            with self._cond:
                m = self._fit(most)
                if m >= 1 and not self._paused:
                    if self._limit_id > self._acked_id:
                        self._reached = time.monotonic()
                        self._drain()
                        self.release(self._limit)
                        self._committed = self.memory.predict(m)
                        self._ack()
                    self._committed = max(self._committed, self.memory.predict(m))
                    self._busy = True
                    return m
                if m < 1 and self._paused:
                    self._ack()
                    t0 = time.monotonic()
                    self._cond.wait(0.5)
                    self.paused_s += time.monotonic() - t0
                    continue
                if m >= 1:  # paused, and a micro-batch fits again: resume, committed to the smallest one
                    self._committed = self.memory.predict(1)
                    self._resuming = True
            if m < 1:  # committed stays until the state is off: an order under it waits for the pause
                self._reached = time.monotonic()
                self._drain()
                self.on_pause()
                self.release(0)
                with self._cond:
                    self._paused, self._committed = True, 0
                    self._ack()
                continue
            t0, back = time.monotonic(), False
            try:
                back = self.on_resume() is not False
            finally:
                with self._cond:
                    self._resuming = False
                    self.resume_s += time.monotonic() - t0
                    if back:
                        self._paused, self._settling = False, True
                    else:
                        self._committed = 0
            if not back:
                self.release(0)

    def _tell_most(self, most: int) -> None:
        """Tell the server the most the job can use (its largest micro-batch's predicted peak, and
        ``MOST_SLACK`` of it) once the memory model has measured a size, and again when the prediction
        leaves the band below what was told, so that ``colocate`` leaves inference what training
        cannot use."""
        if not self.memory.points:
            return
        need = self.memory.predict(most)
        slack = int(need * MOST_SLACK)
        if self._max_bytes - 2 * slack <= need <= self._max_bytes:
            return
        self._max_bytes = need + slack
        chan = self._chan
        if chan is not None:
            chan.send({"t": "most", "bytes": self._max_bytes})

    @property
    def limit(self) -> int | None:
        """Bytes the server allows the job now (None: no limit)."""
        return self._limit

    def resume_stopped(self) -> bool:
        """Whether an order that came during the resume in progress leaves no room for any micro-batch
        (``on_resume`` asks this between chunks and stops, leaving the state off the device)."""
        limit = self._limit
        return self._resuming and limit is not None and limit < self.memory.predict(1)

    def _fit(self, most: int) -> int:
        return most if self._limit is None else self.memory.largest(self._limit, most)

    @contextlib.contextmanager
    def step(self, micro_batch: int):
        state = StepState(micro_batch)
        self._fences.clear()
        self._points = 0
        with self._cond:  # a limit that came after micro_batch() chose this size: abandon at once
            self._running = micro_batch
            self._abandon = (self._immediate and self._limit_id > self._acked_id
                             and self.memory.predict(micro_batch) > self._limit)
        if self.measure is not None:
            self.measure[0]()
        try:
            yield state
        except Abandoned as e:
            # the frames it unwound (the forward's, autograd's) still hold the micro-batch's tensors through
            # the traceback; a reference cycle there can keep them until the garbage collector runs, and the
            # release that follows would not free them: let go of them now
            traceback.clear_frames(e.__traceback__)
            state.abandoned = True
            self.abandoned += 1
        finally:
            with self._cond:
                self._running, self._abandon, self._busy = 0, False, False
        if not state.abandoned and self.measure is not None:
            state.peak_bytes = self.measure[1]()
            if self._settling:
                self._settling = False
            else:
                self.memory.record(micro_batch, state.peak_bytes)

    def watch(self, module) -> None:
        """Hooks on ``module``'s submodules holding parameters, at each call in the forward and each
        gradient of a call's output in the backward: the host waits there until the GPU work queued
        ``run_ahead`` points earlier is done, then an abandon order raises :class:`Abandoned`."""
        def check(*_):
            if self._abandon:
                raise Abandoned()

        def point(t):
            self._bound(t)
            if self._yield:
                self._hold()
            check()

        def on_output(_mod, _inp, out):
            if getattr(out, "requires_grad", False):
                out.register_hook(point)
            point(out)

        for m in module.modules():
            if any(True for _ in m.parameters(recurse=False)):
                m.register_forward_pre_hook(check)
                m.register_forward_hook(on_output)

    def _bound(self, t) -> None:
        """At every ``fence_every``-th point, record a fence after the work queued for ``t`` and wait
        for the fences recorded ``run_ahead`` points back or more."""
        if not self.run_ahead or not hasattr(t, "device"):
            return
        self._points += 1
        n = self._points
        if n % self.fence_every or (ev := self.fence(t)) is None:
            return
        q = self._fences
        q.append((n, ev))
        while q[0][0] <= n - self.run_ahead:
            self._fencing = True
            q.popleft()[1].synchronize()
            self._fencing = False

    def _drain(self) -> None:
        """Wait for the GPU work queued before the release (the last micro-batch's, up to its newest
        fence) so that the ack tells that wait (``drained``) apart from the release itself."""
        if self._fences:
            self._fences[-1][1].synchronize()
            self._fences.clear()
        self._drained = time.monotonic()

    def _hold(self) -> None:
        """Wait while the server holds the compute (an abandon order or a lost server ends it)."""
        t0 = time.monotonic()
        with self._cond:
            self._cond.wait_for(lambda: not self._yield or self._abandon or self._closed)
        self.yielded_s += time.monotonic() - t0

    def close(self) -> None:
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        if self._chan is not None:
            self._chan.close()

    # ---- internals -----------------------------------------------------------------------------

    def _ack(self) -> None:
        """Acknowledge the newest limit (the condition's lock is held): when it was received, when the
        loop reached its release (the order seen at a micro-batch's start, after an abandoned one's
        unwinding; when nothing had to be freed, as received), when the GPU work queued before it was
        done and when the memory was released; and where the loop was when the order came (``at``:
        ``between`` micro-batches, a size ``chosen``, a micro-batch ``running``, or waiting at a ``fence``)."""
        if self._limit_id > self._acked_id and self._chan is not None:
            now = time.monotonic()
            reached = self._received if self._reached is None or self._reached < self._received else self._reached
            reached = min(reached, now)
            drained = reached if self._drained is None or self._drained < reached else min(self._drained, now)
            self._chan.send({"t": "ack", "id": self._limit_id, "bytes": self._limit, "received": self._received,
                             "reached": reached, "drained": drained, "released": now, "at": self._at})
        self._acked_id = self._limit_id
        self._reached = self._drained = None

    def deliver(self, msg: dict) -> None:
        """Handle one message from the server (the receiving thread calls this)."""
        if msg.get("t") == "yield":
            with self._cond:
                self._yield = bool(msg.get("on"))
                self._cond.notify_all()
            return
        if msg.get("t") != "limit":
            return
        with self._cond:
            self._limit, self._limit_id, self._received = int(msg["bytes"]), int(msg["id"]), time.monotonic()
            self._at = ("fence" if self._fencing else "running") if self._running else (
                "chosen" if self._busy else "between")
            self._immediate = bool(msg.get("immediate"))
            if self._committed <= self._limit:
                self._ack()  # nothing to free: answer now (a paused job has committed nothing)
            elif msg.get("immediate") and self._running:
                self._abandon = True
            self._cond.notify_all()

    def _receive(self) -> None:
        while not self._closed:
            try:
                chan = Channel(connect(self.address, timeout=1.0))
            except OSError:
                time.sleep(self.reconnect_s)  # no server (yet, or restarting): keep the last limit
                continue
            chan.send({"t": "hello", "device": self.device, "min_bytes": self._min_bytes,
                       "max_bytes": self._max_bytes})
            with self._cond:
                self._chan = chan
                self._limit_id = self._acked_id = 0  # a new server numbers its limits from 1
            while (msg := chan.recv()) is not None:
                self.deliver(msg)
            with self._cond:
                self._chan, self._yield = None, False  # no server, nothing to yield to
                self._cond.notify_all()
            chan.close()
