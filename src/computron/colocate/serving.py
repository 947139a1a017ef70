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

With ``yield_compute``, ``busy`` also says whether a request waits for its first token (under
``cold``, one that found its model off the device: ``_cold``), and after
every step (``after_step``) the devices are reported again: training, told to yield the compute,
runs again once inference has no such work.

The scheduler stays pure: it only gets budgets. Shares from the arbiter's threads are kept in a
mailbox and the engine thread is woken (``wake``, e.g. ``AsyncEngine.call``) to apply them.
In ``normal`` mode the engine keeps its whole budget and only the training job is told its limit.

The executor's arena follows the share (``EngineCore.set_budget`` / ``fit_memory``): on a GPU its
memory past the share is returned to the driver (``memory/vmm.py``) before training is told it may
grow, and mapped again before inference uses a larger share.

Records (``report``): every handover, split into the arbiter's parts (signal, training's release,
ack; ``ArbiterServer.demand``) and the engine's (``alloc_s``: applying the grant, i.e. mapping the
arena's memory again; ``swap_s``: the swap-ins of the step it was asked for; ``free_s``: from the
arrival at the engine of the first request that asked for the memory to the memory mapped, the whole
handover as that request sees it (``EngineLink._asked_since``)), the limits sent to
training, the shares over time and what inference has booked over time. ``computron serve``
serves them at ``GET /colocation`` and can switch the mode at run time (``POST
/admin/colocation``, :class:`Colocated`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from ..scheduler import RESIDENT
from .arbiter import MODES, YIELDS, Arbiter, ArbiterConfig
from .protocol import RECORDS, ArbiterServer

log = logging.getLogger("computron.colocate")


class EngineLink:
    def __init__(self, core, address: str, config: ArbiterConfig, wake=None, demand_timeout: float = 30.0):
        self.core, self.config, self.wake, self.demand_timeout = core, config, wake, demand_timeout
        ceilings = core.scheduler.config.budgets
        if any(config.capacity > c for c in ceilings):
            raise ValueError(f"the arbiter's capacity of {config.capacity} bytes is more than inference's budget "
                             f"({list(ceilings)} bytes per device)")
        self.devices = len(ceilings)
        self.opened = time.monotonic()
        self.log: deque[tuple[float, int, int]] = deque(maxlen=RECORDS)  # (time, device, bytes) of each budget set
        self.used: deque[tuple[float, int, int]] = deque(maxlen=RECORDS)  # (time, device, bytes booked), on change
        self._used_last: dict[int, int] = {}
        self._swap_for: dict[int, dict] = {}  # device -> the handover of this step, whose swap-ins are timed
        self._mail: dict[int, int] = {}  # device -> latest share sent from another thread
        self._unconfirmed: set[int] = set()  # devices whose reduced share is applied but not yet fitted
        self._mail_lock = threading.Lock()
        self._polling: int | None = None  # the engine thread while it is in poll()
        self._fit: dict[int, tuple[float, int]] = {}  # device -> (clock, core.added) of the last poll its needs fit
        self._cold: set[str] = set()  # ``cold`` yields: requests seen waiting while their model was off its devices
        self.server = ArbiterServer(Arbiter(config, self.devices), address, on_share=self._on_share)
        self.closed = False
        for d in range(self.devices):
            if config.mode == "normal":
                self._set(d, ceilings[d])  # inference keeps (or, after another mode, gets back) its whole budget
                continue
            first = config.capacity - config.static_train if config.mode == "static" else 0
            self._set(d, first)
            if first:
                self.server.demand(d, first)  # no training yet: granted at once
        core.listeners.append(self._on_swap)
        core.colocation = self

    # ---- the engine thread -------------------------------------------------------------------

    def poll(self) -> None:
        if self.closed:  # a wake-up posted before the link was closed (a mode switch)
            return
        self._polling = threading.get_ident()
        self._swap_for.clear()  # the last step's loads, if any, came in (``_on_swap``)
        try:
            self._apply_mail()
            sched = self.core.scheduler
            now = self.core.clock()
            for d in range(self.devices):
                need = sched.need_bytes(d)
                if not need or need <= sched.shares[d] or self.config.mode == "normal":
                    self._fit[d] = (now, self.core.added)
                if not need:
                    continue
                self.server.busy(d, self._first_token(d))
                if need > sched.shares[d] and self.config.mode != "normal":
                    first = self._asked_since(d)
                    try:
                        rec = self.server.demand(d, need, self.demand_timeout)
                    except TimeoutError as e:
                        log.warning("colocation: %s; the scheduler works in %d bytes", e, sched.shares[d])
                    else:
                        if rec["signal_s"] is not None:  # training's memory moved: time inference's part
                            t = time.monotonic()
                            self._apply_mail()  # the grant: the arena maps the memory again
                            rec["alloc_s"] = time.monotonic() - t
                            if first is not None:  # from the arrival of the first request that asked
                                rec["free_s"] = self.core.clock() - first
                            self._swap_for[d] = rec  # the swap-ins of this step
                        if sched.shares[d] >= need:  # granted: later requests ask anew
                            self._fit[d] = (self.core.clock(), self.core.added)
            self._apply_mail()
            self._record_used()
        finally:
            self._polling = None

    def after_step(self) -> None:
        """The engine thread, after a step: devices with no work (or, for ``first-token``, none waiting
        for a first token) left give training the compute back."""
        if self.closed or self.config.yield_compute == "none":
            return
        sched = self.core.scheduler
        for d in range(self.devices):
            if sched.need_bytes(d):
                self.server.busy(d, self._first_token(d))
            else:
                self.server.quiet(d)

    def _first_token(self, device: int) -> bool:
        """A request of a model on ``device`` waits for its first token (only asked with ``first-token``);
        with ``cold``, one that was seen waiting while its model was not resident (its swap-in, then its
        prefill)."""
        policy = self.config.yield_compute
        if policy not in ("first-token", "cold"):
            return True
        models, reqs = self.core.models, self.core.requests

        def waits(r) -> bool:
            return r.first_token_at is None and device in models[r.model].placement.devices

        if policy == "first-token":
            return any(map(waits, reqs.values()))
        sched = self.core.scheduler.models
        self._cold = {i for i in self._cold if (r := reqs.get(i)) is not None and r.first_token_at is None}
        cold = [r.id for r in reqs.values() if waits(r) and (r.id in self._cold or sched[r.model].state != RESIDENT)]
        self._cold.update(cold)
        return bool(cold)

    def close(self) -> None:
        self.closed = True
        if self.core.colocation is self:
            self.core.colocation = None
        if self._on_swap in self.core.listeners:
            self.core.listeners.remove(self._on_swap)
        self.server.close()

    def report(self, since: float | None = None) -> dict:
        """Records since ``since`` (``time.monotonic()``, one clock for the machine's processes) as
        plain JSON: the settings, the arbiter's records (``ArbiterServer.records``), the budgets
        applied and the bytes inference booked. Safe from any thread."""
        c = self.config
        used = [list(r) for r in list(self.used) if since is None or r[0] >= since]
        budgets = [list(r) for r in list(self.log) if since is None or r[0] >= since]
        sched = self.core.scheduler
        booked = [sched.shares[d] - sched.free_bytes(d) for d in range(self.devices)]
        return {"mode": c.mode, "capacity": c.capacity, "static_train": c.static_train, "idle_s": c.idle_s,
                "immediate": c.immediate, "yield_compute": c.yield_compute, "address": self.server.address,
                "opened": self.opened,
                "now": time.monotonic(), **self.server.records(since), "budgets": budgets, "used": used,
                "booked": booked}

    # ---- internals ---------------------------------------------------------------------------

    def _on_share(self, device: int, nbytes: int) -> bool:
        """Called by the arbiter server (its lock held). On the engine thread: applied now. Else
        posted; False for a reduction, confirmed by ``released`` once the engine fits in it."""
        if self.config.mode == "normal" or self.closed:
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

    def _asked_since(self, device: int) -> float | None:
        """When (the engine's clock) the memory about to be demanded on ``device`` was first asked for:
        the arrival of the first request not started yet of a model on the device among those the core
        took since the last poll that found the device's needs within its share (requests waiting since
        before it, e.g. behind another model's swap-in, asked for nothing more); that poll's time when
        none did (the share shrank meanwhile). Before any such poll: the oldest waiting request's arrival."""
        models, (at, added) = self.core.models, self._fit.get(device, (None, 0))
        first = min((r.arrival for r in self.core.requests.values()
                     if r.added >= added and r.first_token_at is None and device in models[r.model].placement.devices),
                    default=None)
        return at if first is None else first

    def _on_swap(self, kind: str, model: str, seconds: float, nbytes: int) -> None:
        """An engine listener (engine thread): loads after a handover are its swap-in."""
        if kind != "load" or not self._swap_for:
            return
        info = self.core.models.get(model)
        for d in (info.placement.devices if info is not None else ()):
            rec = self._swap_for.get(d)
            if rec is not None:
                rec["swap_s"] = (rec["swap_s"] or 0.0) + seconds

    def _record_used(self) -> None:
        sched = self.core.scheduler
        for d in range(self.devices):
            used = sched.shares[d] - sched.free_bytes(d)
            if self._used_last.get(d) != used:
                self._used_last[d] = used
                self.used.append((time.monotonic(), d, used))

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
    g.add_argument("--colocate-yield", choices=YIELDS, default="none",
                   help="static and colocate modes: training yields the GPU's compute while inference has work "
                        "(work), while a request waits for its first token (first-token), or never (none)")


class Colocated:
    """``serve --colocate``: the link of a running server, which a mode switch replaces (``switch``:
    the old arbiter closes, its job keeps its last limit and finds the new one at the same address)."""

    def __init__(self, async_engine, address: str, config: ArbiterConfig):
        self.ae, self.address = async_engine, address
        self.link = async_engine.call(EngineLink, async_engine.engine.core, address, config,
                                      wake=async_engine.call).result()

    def switch(self, mode: str | None = None, idle_s: float | None = None, static_train: int | None = None,
               immediate: bool | None = None, yield_compute: str | None = None) -> dict:
        """On the engine thread: a new link with these settings (the others kept). ValueError for a
        bad one (the old link stays)."""
        import dataclasses

        changes = {k: v for k, v in dict(mode=mode, idle_s=idle_s, static_train=static_train,
                                         immediate=immediate, yield_compute=yield_compute).items() if v is not None}
        cfg = dataclasses.replace(self.link.config, **changes)  # checked here, before anything closes
        self.link.close()
        self.link = EngineLink(self.ae.engine.core, self.address, cfg, wake=self.ae.call)
        log.info("colocation: switched to mode %s (idle %.2f s, static training share %d bytes, training yields "
                 "compute: %s)", cfg.mode, cfg.idle_s, cfg.static_train, cfg.yield_compute)
        return self.link.report(self.link.opened)

    def close(self) -> None:
        self.link.close()


def add_routes(app, colocated: Colocated) -> None:
    """``GET /colocation[?since=T]``: the link's records (``EngineLink.report``); ``POST
    /admin/colocation`` with any of ``mode``, ``idle_s``, ``static_train`` (bytes or a size),
    ``at_boundary``, ``yield_compute``: switch the mode at run time (the admin key's)."""
    from fastapi import Body

    from ..config import parse_bytes
    from ..server.errors import APIError

    @app.get("/colocation")
    async def colocation(since: float | None = None):
        return colocated.link.report(since)

    @app.post("/admin/colocation")
    async def switch(body: dict = Body(...)):
        unknown = sorted(set(body) - {"mode", "idle_s", "static_train", "at_boundary", "yield_compute"})
        if unknown:
            raise APIError(400, f"unknown field(s) {', '.join(unknown)}; known: mode, idle_s, static_train, "
                           "at_boundary, yield_compute", unknown[0], "invalid_field")
        if body.get("at_boundary") is not None and not isinstance(body["at_boundary"], bool):
            raise APIError(400, f"at_boundary must be true or false, got {body['at_boundary']!r}", "at_boundary",
                           "invalid_value")
        try:
            kw = dict(mode=body.get("mode"), idle_s=None if body.get("idle_s") is None else float(body["idle_s"]),
                      static_train=None if body.get("static_train") is None else parse_bytes(body["static_train"]),
                      immediate=None if body.get("at_boundary") is None else not body["at_boundary"],
                      yield_compute=body.get("yield_compute"))
            return await colocated.ae.run(colocated.switch, **kw)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), None, "invalid_value") from None


def attach(args, async_engine) -> Colocated | None:
    """The link ``serve`` opens when ``--colocate`` is given (None otherwise); its capacity is
    inference's whole budget for weights and KV cache."""
    if not getattr(args, "colocate", None):
        return None
    from ..config import parse_bytes

    core = async_engine.engine.core
    cap = min(core.scheduler.config.budgets)
    cfg = ArbiterConfig(mode=args.colocate_mode, capacity=cap, idle_s=args.colocate_idle,
                        static_train=parse_bytes(args.colocate_static_train), immediate=not args.colocate_at_boundary,
                        yield_compute=getattr(args, "colocate_yield", "none"))
    colocated = Colocated(async_engine, args.colocate, cfg)
    log.info("colocation: arbiter on %s, mode %s, %d bytes per device shared", args.colocate, cfg.mode, cap)
    return colocated
