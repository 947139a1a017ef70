"""The serving engine under the arbiter: inference's memory is asked for before it is used.

``EngineLink(core, address, config)`` opens an :class:`ArbiterServer` beside an ``EngineCore``
(``core.colocation = link``). Before every step, on the engine's thread, ``poll``:

1. reports the devices with work as busy (memory goes back to training only after ``idle_s``
   without work);
2. for each device where the work's needs (``Scheduler.need_bytes``: weights of the models with
   requests, their KV cache at full length) exceed inference's share, calls ``demand`` and blocks
   until training has acknowledged (milliseconds); the grant arrives as ``on_share`` on this
   same thread and becomes the scheduler's budget (``EngineCore.set_budget``);
3. applies budgets that arrived from the arbiter's own threads meanwhile: a larger one at once;
   a smaller one (inference idle) evicts idle models down to it, then confirms with
   ``released`` so that training may grow into it.

The scheduler stays pure: it only gets budgets. Shares from the arbiter's threads are kept in a
mailbox and the engine thread is woken (``wake``, e.g. ``AsyncEngine.call``) to apply them.
In ``normal`` mode the engine keeps its whole budget and only the training job is told its limit.

The executor's arena follows the share (``EngineCore.set_budget`` / ``fit_memory``): on a GPU its
memory past the share is returned to the driver (``memory/vmm.py``) before training is told it may
grow, and mapped again before inference uses a larger share.
"""

from __future__ import annotations

import logging
import threading
import time

from .arbiter import MODES, Arbiter, ArbiterConfig
from .protocol import ArbiterServer

log = logging.getLogger("computron.colocate")


class EngineLink:
    def __init__(self, core, address: str, config: ArbiterConfig, wake=None, demand_timeout: float = 30.0):
        self.core, self.config, self.wake, self.demand_timeout = core, config, wake, demand_timeout
        ceilings = core.scheduler.config.budgets
        if any(config.capacity > c for c in ceilings):
            raise ValueError(f"the arbiter's capacity of {config.capacity} bytes is more than inference's budget "
                             f"({list(ceilings)} bytes per device)")
        self.devices = len(ceilings)
        self.log: list[tuple[float, int, int]] = []  # (time, device, bytes) of every budget applied
        self._mail: dict[int, int] = {}  # device -> latest share sent from another thread
        self._unconfirmed: set[int] = set()  # devices whose reduced share is applied but not yet fitted
        self._mail_lock = threading.Lock()
        self._polling: int | None = None  # the engine thread while it is in poll()
        self.server = ArbiterServer(Arbiter(config, self.devices), address, on_share=self._on_share)
        for d in range(self.devices):
            if config.mode == "normal":
                continue  # inference keeps its whole budget
            first = config.capacity - config.static_train if config.mode == "static" else 0
            self._set(d, first)
            if first:
                self.server.demand(d, first)  # no training yet: granted at once
        core.colocation = self

    # ---- the engine thread -------------------------------------------------------------------

    def poll(self) -> None:
        self._polling = threading.get_ident()
        try:
            self._apply_mail()
            sched = self.core.scheduler
            for d in range(self.devices):
                need = sched.need_bytes(d)
                if not need:
                    continue
                self.server.busy(d)
                if need > sched.shares[d] and self.config.mode != "normal":
                    try:
                        self.server.demand(d, need, self.demand_timeout)
                    except TimeoutError as e:
                        log.warning("colocation: %s; the scheduler works in %d bytes", e, sched.shares[d])
            self._apply_mail()
        finally:
            self._polling = None

    def close(self) -> None:
        self.core.colocation = None
        self.server.close()

    # ---- internals ---------------------------------------------------------------------------

    def _on_share(self, device: int, nbytes: int) -> bool:
        """Called by the arbiter server (its lock held). On the engine thread: applied now. Else
        posted; False for a reduction, confirmed by ``released`` once the engine fits in it."""
        if self.config.mode == "normal":
            return True
        if self._polling == threading.get_ident():
            with self._mail_lock:
                self._mail.pop(device, None)
                self._unconfirmed.discard(device)
            self._set(device, nbytes)
            return True
        with self._mail_lock:
            self._mail[device] = nbytes
        if self.wake is not None:
            self.wake(self.poll)
        return nbytes >= self.core.scheduler.shares[device]

    def _apply_mail(self) -> None:
        with self._mail_lock:
            mail, self._mail = self._mail, {}
        for d, nbytes in mail.items():
            if nbytes < self.core.scheduler.shares[d]:
                self._unconfirmed.add(d)
            self._set(d, nbytes)
        for d in sorted(self._unconfirmed):
            if self.core.scheduler.free_bytes(d) >= 0:  # evicted down to it: training may grow now
                self._unconfirmed.discard(d)
                self.core.fit_memory(d)  # the arena gives the bytes back to the device first
                self.server.released(d)

    def _set(self, device: int, nbytes: int) -> None:
        if nbytes != self.core.scheduler.shares[device]:
            self.core.set_budget(device, nbytes)
            self.log.append((time.monotonic(), device, nbytes))
            log.info("colocation: device %d inference budget %d bytes", device, nbytes)


# ---- `computron serve --colocate ADDRESS` ---------------------------------------------------------

def add_arguments(p) -> None:
    g = p.add_argument_group("colocation (a training job shares the devices; see docs/colocate.md)")
    g.add_argument("--colocate", metavar="ADDRESS", help="open the memory arbiter on this Unix socket or host:port")
    g.add_argument("--colocate-mode", choices=MODES, default="colocate")
    g.add_argument("--colocate-idle", type=float, default=1.0, metavar="SECONDS",
                   help="inference idle this long gives its memory back to training")
    g.add_argument("--colocate-static-train", default="0", metavar="SIZE", help="static mode: training's share")
    g.add_argument("--colocate-at-boundary", action="store_true",
                   help="training releases at its next micro-batch boundary instead of abandoning it")


def attach(args, async_engine):
    """The link ``serve`` opens when ``--colocate`` is given (None otherwise); its capacity is
    inference's whole budget for weights and KV cache."""
    if not getattr(args, "colocate", None):
        return None
    from ..config import parse_bytes

    core = async_engine.engine.core
    cap = min(core.scheduler.config.budgets)
    cfg = ArbiterConfig(mode=args.colocate_mode, capacity=cap, idle_s=args.colocate_idle,
                        static_train=parse_bytes(args.colocate_static_train), immediate=not args.colocate_at_boundary)
    link = async_engine.call(EngineLink, core, args.colocate, cfg, wake=async_engine.call).result()
    log.info("colocation: arbiter on %s, mode %s, %d bytes per device shared", args.colocate, cfg.mode, cap)
    return link
