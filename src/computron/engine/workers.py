"""WorkerExecutor: the executor protocol served by one worker process per device (parent side).

The parent's end of each worker is a ``_Worker`` (``workers_proxy.py``); workers of other nodes
connect through ``workers_remote.py``. The worker processes (``spawn`` context) run
``worker_loop.worker_main``: each builds an ``InProcessExecutor`` from the engine's config and
answers the protocol's calls from a ``multiprocessing`` pipe. This side is a thin proxy: every call
is one message ``(id, call, args)`` sent to every rank of the model's placement; the rank that
samples answers with the value (for ``execute``: the tokens). Only the dataclasses of
``computron.messages`` and plain values cross (pickled between our own processes; nothing a user
sent is ever unpickled). The message format is described in ``worker_loop``; a registration's
progress strings come back as interim messages, given to the ``progress`` callback on this
executor's receiver thread. The round trip of a step (~200 µs) is hidden behind the device's work
by the workers themselves: a step the engine marks ``ahead`` (a steady batch it expects to repeat)
makes the worker start the next step before it is asked for (``ahead.py``; ``run_ahead`` in the
config, on by default); this side sends and reads steps as ever.

Failure: one receiver thread per worker waits on the pipe and the process sentinel together
(``multiprocessing.connection.wait``, 0.5 s timeout), so a worker that dies is noticed at once.
Its calls in flight end: an ``execute`` with a ``StepResult`` whose ``lost_devices`` lists the
worker's device and whose requests all failed ("worker for device 0 died (exit code -9)"), any
other call with a ``WorkerDied`` (a RuntimeError). The worker is then restarted in the background
and every model it knew is registered again (offloaded); calls wait for that. With several
devices the whole world is restarted (``_restart_world``): the other workers are killed (they may
wait in a collective on the dead one), a new process group starts on a new port, every model is
registered again on all of them, and the step reports the other devices in ``reset_devices``:
their models are gone, their requests did not need the dead worker (the core requeues them). A
death noticed outside an ``execute`` is reported by the next ``execute`` (it runs nothing; only
its requests whose caches were on the dead worker fail; nothing of the fresh worker stays
resident), so the engine core always learns that the models are offloaded.
Exceptions raised in the worker come back with their type name and message, as subclasses of
the nearest of ValueError/KeyError/FileNotFoundError/MemoryError/TimeoutError (else
RuntimeError), so the engine maps bad input to user errors as with the in-process executor.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

from ..memory.shared import remove_images
from ..messages import (ExecuteBatch, ExecutorStatus, ModelDescription, ModelInfo, Residency, SeqInput,
                        StepResult)
from .executor import check_stripe
from .workers_proxy import WorkerDied, _free_port, _Worker
from .workers_remote import NodeListener, hang_up, parse_address

log = logging.getLogger("computron.workers")


# ---- the executor --------------------------------------------------------------------------------
class WorkerExecutor:
    """The executor protocol over worker processes, one per device."""

    def __init__(self, config, start_timeout: float = 120.0, call_timeout: float = 600.0, listen: str | None = None,
                 authkey: str | None = None, local_devices: int | None = None):
        """``listen`` (``HOST:PORT``; default ``config.workers_listen``, else
        ``$COMPUTRON_WORKERS_LISTEN``): also take workers of other nodes there, authenticated with
        ``authkey`` (default ``$COMPUTRON_WORKER_AUTHKEY``); this node then starts the workers of
        devices 0 .. ``local_devices`` - 1 (default ``config.local_devices``, else
        ``$COMPUTRON_LOCAL_DEVICES``) and waits for the others to connect (``computron worker``)."""
        # What each worker runs: the in-process executor, or the legacy one for the computron policy.
        self.config = dataclasses.replace(config, executor="legacy" if config.policy == "computron" else "inprocess")
        self.start_timeout, self.call_timeout = start_timeout, call_timeout
        self.devices = tuple(range(config.devices))
        if not self.devices:
            raise ValueError(f"devices must be at least 1, got {config.devices}")
        listen = listen or config.workers_listen or os.environ.get("COMPUTRON_WORKERS_LISTEN") or None
        self._check_stripes(config, listen)
        local_devices = local_devices if local_devices is not None else config.local_devices
        self._nodes: NodeListener | None = None
        self._master, self.local = "127.0.0.1", len(self.devices)
        if listen:
            host, port = parse_address(listen)
            local = local_devices if local_devices is not None else os.environ.get("COMPUTRON_LOCAL_DEVICES")
            if local is None or not str(local).isdigit() or not 1 <= int(local) <= len(self.devices):
                raise ValueError(f"with workers of other nodes, say how many of the {len(self.devices)} devices are "
                                 f"this node's (--local-devices, engine.local_devices or $COMPUTRON_LOCAL_DEVICES, 1 to "
                                 f"{len(self.devices)}; device 0 is "
                                 f"always here), got {local!r}")
            self.local = int(local)
            self._master = host if host not in ("", "0.0.0.0") else socket.getfqdn()
            key = authkey if authkey is not None else os.environ.get("COMPUTRON_WORKER_AUTHKEY", "")
            self._nodes = NodeListener((host, port), key.encode())
        self._ctx = mp.get_context("spawn")
        self._lock = threading.RLock()
        self._descs: dict[str, ModelDescription] = {}  # every model registered, kept to re-register
        # Not yet reported by an execute: devices whose worker died, and devices whose worker was
        # restarted with them (with several devices the world is restarted).
        self._dead: set[int] = set()
        self._reset: set[int] = set()
        self._ready = {d: threading.Event() for d in self.devices}  # cleared while a worker restarts
        self._broken: dict[int, BaseException] = {}  # a restart that failed
        self._last_status: dict[int, ExecutorStatus] = {}
        self._restarts: list[threading.Thread] = []
        self._rebuilding = False  # a new world is being started (several devices)
        self._cause = ""  # why the workers were last restarted: the reason lost requests fail with
        self._closed = False
        self.restarts = 0
        # Each model's last load on each of its devices, seconds (its report keeps the slowest rank's).
        self.rank_loads: dict[str, dict[int, float]] = {}
        self._workers: dict[int, _Worker] = {}
        try:
            self._workers = self._start_world()
        except BaseException:
            if self._nodes is not None:
                self._nodes.close()
            raise
        for d in self.devices:
            self._ready[d].set()

    def _check_stripes(self, config, listen: str | None) -> None:
        """Striped swap-ins under workers: helpers are devices of this engine, on this node (a helper maps
        the model's host image from this node's shared memory)."""
        stripe = config.stripe_devices
        if not stripe:
            return
        if config.policy == "computron":
            raise ValueError("stripe_devices: this executor copies through one link (the legacy executor, as the "
                             "original did); striped swap-ins are the in-process and worker executors'")
        bad = [d for d in stripe if d >= len(self.devices)]
        if bad:
            raise ValueError(f"stripe_devices {bad}: under workers a helper is one of the engine's {len(self.devices)} "
                             f"devices (0 to {len(self.devices) - 1})")
        if listen:
            raise ValueError("stripe_devices with workers of other nodes: a helper reads the model's host image "
                             "from shared memory of the model's node, so striped swap-ins need every worker on "
                             "one node (leave out --workers-listen or stripe_devices)")

    def _start_world(self) -> dict[int, _Worker]:
        """A worker per device, all started at once: with several devices each waits for the others
        in a new process group (on a new port)."""
        port = _free_port() if len(self.devices) > 1 else 0
        workers: dict[int, _Worker] = {}
        try:
            for d in self.devices[:self.local]:
                workers[d] = _Worker.spawn(self._ctx, self.config, d, self._on_death, len(self.devices), port,
                                           self._master)
            if self._nodes is not None:
                self._join_remote(workers, port)
            for w in workers.values():
                w.wait_started(self.start_timeout)
        except BaseException:
            for w in workers.values():
                w.kill()
            raise
        return workers

    def _start(self, device: int) -> _Worker:
        w = _Worker.spawn(self._ctx, self.config, device, self._on_death)
        w.wait_started(self.start_timeout)
        return w

    # ---- ranks -----------------------------------------------------------------------------------
    def _worker(self, device: int) -> _Worker:
        """The live worker of a device, waiting for a restart under way."""
        if not self._ready[device].wait(self.start_timeout + self.call_timeout):
            raise RuntimeError(f"worker for device {device} did not come back in time")
        if device in self._broken:
            raise RuntimeError(f"worker for device {device} could not be restarted: {self._broken[device]}")
        return self._workers[device]

    def _ranks(self, devices) -> list[_Worker]:
        """The workers of a placement's devices, rank order (rank 0 first)."""
        return [self._worker(d) for d in devices]

    def _model_devices(self, name: str) -> tuple[int, ...]:
        desc = self._descs.get(name)
        return desc.placement.devices if desc is not None else self.devices

    def _wait(self, fut: Future, device: int, name: str, timeout: float | None = None):
        try:
            return fut.result(timeout or self.call_timeout)
        except FutureTimeout:
            raise RuntimeError(f"worker for device {device} did not answer {name} within "
                               f"{timeout or self.call_timeout:.0f} s") from None

    def _broadcast(self, devices, name: str, *args, progress=None, timeout: float | None = None):
        """Send a call to every rank; every rank must succeed; rank 0's answer is the value."""
        return self._broadcast_all(devices, name, *args, progress=progress, timeout=timeout)[0]

    def _broadcast_all(self, devices, name: str, *args, progress=None, timeout: float | None = None) -> list:
        """Send a call to every rank at once; every rank must succeed; their answers in rank order."""
        workers = self._ranks(devices)
        futs = [w.call(name, *args, progress=progress if i == 0 else None) for i, w in enumerate(workers)]
        return [self._wait(f, w.device, name, timeout) for f, w in zip(futs, workers)]

    def _answerer(self, name: str) -> int:
        """The device whose rank samples a model's tokens: its last stage's first tensor rank."""
        desc = self._descs.get(name)
        if desc is None:
            return self.devices[0]
        dims = desc.placement.dims
        return desc.placement.devices[(dims.pp - 1) * dims.tp]

    # ---- failure -------------------------------------------------------------------------------
    def _on_death(self, w: _Worker, cause: WorkerDied | None = None) -> None:
        """Called by a worker's receiver thread (or a step) when it finds the worker dead: restart
        it, or with several devices the whole world (the process groups it was in are broken)."""
        cause = cause or w.dead or w._death()
        with self._lock:
            if self._closed or self._workers.get(w.device) is not w or self._rebuilding \
                    or not self._ready[w.device].is_set():
                return  # gone already, or a restart is under way
            self._cause = str(cause)
            if len(self.devices) > 1:
                self._rebuilding = True
                self._dead.add(w.device)
                self._reset.update(self.devices)
                for d in self.devices:
                    self._ready[d].clear()
                target, args, name = self._restart_world, (cause,), "computron-restart-world"
            else:
                self._dead.add(w.device)
                self._ready[w.device].clear()
                target, args, name = self._restart, (w.device,), f"computron-restart-{w.device}"
            t = threading.Thread(target=target, args=args, name=name, daemon=True)
            self._restarts.append(t)
            t.start()

    def _join_remote(self, workers: dict[int, _Worker], port: int) -> None:
        """Wait for a worker of another node for each device past this node's, assign it its device
        (the one it asks for, if free) and the process group's address."""
        free = list(self.devices[self.local:])
        deadline = time.monotonic() + self.start_timeout
        while free:
            try:
                conn, (_, want, pid, host) = self._nodes.take(deadline - time.monotonic())
            except queue.Empty:
                raise RuntimeError(
                    f"device(s) {free} have no worker: none connected to {self._nodes.address[0]}:"
                    f"{self._nodes.address[1]} within {self.start_timeout:.0f} s (start them on their node with "
                    f"`computron worker --connect HOST:PORT`; see docs/engine.md)") from None
            if want is not None and want not in free:
                log.warning("a worker on %s asked for device %s, which is not waiting for one (free: %s)",
                            host, want, free)
                try:
                    conn.send(("refuse", f"device {want} is not one the engine waits for (free: {free})"))
                except OSError:
                    pass
                hang_up(conn)
                continue
            device = want if want is not None else free[0]
            try:
                conn.send(("assign", self.config, device, len(self.devices), self._master, port))
            except OSError:  # it went away meanwhile: wait for another
                continue
            free.remove(device)
            workers[device] = _Worker(device, self._on_death, conn, pid=pid, where=str(host))

    def _restart_world(self, cause: WorkerDied, attempts: int = 2) -> None:
        """Every worker ends (those still alive may wait in a collective on the dead one: killed,
        their calls in flight failing with ``cause``); a new world starts on a new port and every
        model is registered again, one at a time on all workers (the order of process-group
        creation must be the same everywhere), all offloaded."""
        for w in list(self._workers.values()):
            w.kill(cause)
        remove_images(os.getpid())  # shared host images of the killed workers (striped swap-ins)
        error: BaseException | None = None
        for _ in range(attempts):
            workers: dict[int, _Worker] = {}
            try:
                workers = self._start_world()
                for desc in list(self._descs.values()):
                    futs = {d: w.call("register", desc, False) for d, w in workers.items()}
                    for d, f in futs.items():
                        try:
                            self._wait(f, d, "register", timeout=max(self.call_timeout, 3600.0))
                        except WorkerDied:
                            raise
                        except Exception as e:  # it stays known; its requests will fail with the reason
                            log.error("re-registering %s on device %d after a restart failed: %s", desc.name, d, e)
                with self._lock:
                    if self._closed:
                        raise RuntimeError("the executor was shut down")
                    if any(w.dead is not None for w in workers.values()):
                        raise next(w.dead for w in workers.values() if w.dead is not None)
                    self._workers = workers
                    self._broken.clear()
                    self.restarts += 1
                    self._rebuilding = False
                    for d in self.devices:
                        self._ready[d].set()
                log.warning("%s: the workers of all %d devices were restarted; their %d model(s) are offloaded",
                            cause, len(self.devices), len(self._descs))
                return
            except BaseException as e:  # noqa: BLE001 -- said below, to every call that waits
                error = e
                for w in workers.values():
                    w.kill()
                if self._closed:
                    break
        with self._lock:
            for d in self.devices:
                self._broken[d] = error
            self._rebuilding = False
            for d in self.devices:
                self._ready[d].set()

    def _restart(self, device: int) -> None:
        """A fresh worker with every model registered again (all offloaded)."""
        try:
            w = self._start(device)
            for desc in list(self._descs.values()):
                if device in desc.placement.devices:
                    try:
                        self._wait(w.call("register", desc, False), device, "register")
                    except Exception as e:  # it stays known; its requests will fail with the reason
                        log.error("re-registering %s after a restart failed: %s", desc.name, e)
            if w.dead is not None:
                raise w.dead
            with self._lock:
                if self._closed:
                    w.stop()
                    return
                self._workers[device] = w
                self._broken.pop(device, None)
                self.restarts += 1
            log.warning("worker for device %d restarted; its %d model(s) are offloaded", device, len(self._descs))
        except BaseException as e:
            self._broken[device] = e
        finally:
            self._ready[device].set()

    def _lost_result(self, batches: list[ExecuteBatch], why: str, dead: set[int], reset: set[int],
                     ran: bool = True) -> StepResult:
        """A step that a death cut short (``ran``) or found before it began: the requests that needed a
        dead worker fail with ``why`` (those of a batch with a rank there; before the step began,
        only those whose caches were there, not those about to start); the others get no token, and
        the core requeues them, as their models are gone from the restarted workers."""
        failed = {s.req_id: why for b in batches if dead.intersection(self._model_devices(b.model))
                  for s in b.seqs if ran or s.past > 0}
        return StepResult(failed=failed, lost_devices=sorted(dead), reset_devices=sorted(reset - dead))

    def _lost_step(self, batches: list[ExecuteBatch], died: WorkerDied, dead: set[int]) -> StepResult:
        """A step during which a worker died: the requests that needed it fail with the death's
        reason, and it reports every device whose models are gone (with several devices: all, as
        the world is restarted), so the next step has nothing more to report."""
        with self._lock:
            dead = set(dead) | self._dead
            reset = set(self._reset)
            self._dead -= dead
            self._reset.clear()
            why = self._cause or str(died)
        return self._lost_result(batches, why, dead, reset)

    # ---- the protocol --------------------------------------------------------------------------
    def register(self, desc: ModelDescription, progress: Callable[[str], None] | None = None) -> ModelInfo:
        """Every worker is called (a sharded model's process groups are made by all of them); the
        model's ranks build their shards and answer their bytes, gathered here in rank order."""
        pl = desc.placement
        if max(pl.devices) >= len(self.devices):
            raise ValueError(f"model {desc.name!r} is placed on devices {list(pl.devices)}, but there are "
                             f"{len(self.devices)} (devices: {len(self.devices)})")
        everyone = self.devices if len(self.devices) > 1 else pl.devices
        answers = dict(zip(everyone, self._broadcast_all(everyone, "register", desc, progress is not None,
                                                         progress=progress, timeout=max(self.call_timeout, 3600.0))))
        infos = [answers[d] for d in pl.devices]
        info = dataclasses.replace(infos[0], weight_bytes=tuple(i.weight_bytes[0] for i in infos),
                                   kv_bytes_per_token=tuple(i.kv_bytes_per_token[0] for i in infos))
        with self._lock:
            self._descs[desc.name] = desc
        return info

    def unregister(self, name: str) -> None:
        """The model's ranks drop it; with stripe_devices every worker does (a helper drops its mapping
        of the model's shared image, so the memory goes back)."""
        devices = self.devices if self.config.stripe_devices else self._model_devices(name)
        with self._lock:
            self._descs.pop(name, None)
        self._broadcast(devices, "unregister", name)

    def apply(self, change: Residency) -> dict[str, float]:
        """Each worker gets the changes of the models it holds a rank of (all at once); an eviction
        takes as long as its slowest rank. A striped load (``change.stripes``) goes to its helpers too:
        they relay their chunks while the model's worker receives them."""
        for name, helpers in change.stripes.items():
            check_stripe(name, self._model_devices(name), helpers, self.config.stripe_devices)
        parts = {d: Residency([n for n in change.evict if d in self._model_devices(n)],
                              [n for n in change.load if d in self._model_devices(n)], change.release,
                              change.kv_out, change.kv_in,
                              {n: hs for n, hs in change.stripes.items() if d in hs or d in self._model_devices(n)})
                 for d in self.devices}
        parts = {d: r for d, r in parts.items() if r}
        evicted: dict[str, float] = {}
        workers = self._ranks(list(parts))
        futs = [w.call("apply", parts[w.device]) for w in workers]
        for f, w in zip(futs, workers):
            for name, sec in self._wait(f, w.device, "apply").items():
                evicted[name] = max(sec, evicted.get(name, 0.0))
        return evicted

    def execute(self, batches: list[ExecuteBatch]) -> Future:
        """One step of each batch. A run of several decode steps (``steps`` > 1) of a model on one
        device goes to its worker as it is (the worker feeds each step's tokens to the next); a
        sharded model's run is driven from here, a step at a time, since its ranks must meet in
        every step's collectives."""
        out: Future = Future()
        try:
            runs = [b for b in batches if b.steps > 1 and len(self._model_devices(b.model)) > 1]
            out.set_result(self._run_steps(batches, runs) if runs else self._step(batches))
        except Exception as e:
            out.set_exception(e)
        return out

    def _run_steps(self, batches: list[ExecuteBatch], runs: list[ExecuteBatch]) -> StepResult:
        """The first step of every batch (the others' whole runs, sent as they are), then the next
        steps of the sharded runs, each sequence's token fed to its next step. Their tokens come
        back as lists, as a worker's own run gives them; a device lost midway ends the run, failing
        its requests."""
        sharded = {id(b) for b in runs}
        first = [dataclasses.replace(b, steps=1) if id(b) in sharded else b for b in batches]
        result = self._step(first)
        if result.lost_devices or result.reset_devices:
            return result
        # Requests that failed in a step are not carried on; a run returns no log-probabilities (as a
        # worker's own run does not).
        seqs = {b.model: [s for s in b.seqs if s.req_id in result.tokens] for b in runs}
        tokens = {s.req_id: [result.tokens[s.req_id]] for ss in seqs.values() for s in ss}
        for rid in tokens:
            result.logprobs.pop(rid, None)
        for i in range(1, max(b.steps for b in runs)):
            step = []
            for b in runs:
                if i < b.steps:
                    seqs[b.model] = [SeqInput(s.req_id, [tokens[s.req_id][-1]], s.past + len(s.tokens), s.params)
                                     for s in seqs[b.model] if s.req_id in tokens]
                    step.append(ExecuteBatch(b.model, seqs[b.model]))
            one = self._step(step)
            result.failed.update(one.failed)
            for rid in one.failed:
                tokens.pop(rid, None)
                result.tokens.pop(rid, None)
            if one.lost_devices or one.reset_devices:
                result.lost_devices, result.reset_devices = one.lost_devices, one.reset_devices
                break
            result.loaded.update(one.loaded)
            for name, sec in one.compute_s.items():
                result.compute_s[name] = result.compute_s.get(name, 0.0) + sec
            for rid, t in one.tokens.items():
                tokens[rid].append(t)
        result.tokens.update(tokens)
        return result

    def _step(self, batches: list[ExecuteBatch]) -> StepResult:
        """One call to the workers of the batches' devices; raises what a worker raised."""
        with self._lock:
            dead, reset = self._dead, self._reset
            self._dead, self._reset = set(), set()
        if dead or reset:  # a worker died since the last step: the models there are gone; say so first
            for d in sorted(dead | reset):
                try:  # the fresh worker must hold nothing the core will believe offloaded
                    self._broadcast([d], "apply", Residency(evict=list(self._broadcast([d], "status").models)))
                except Exception:
                    pass
            why = self._cause or "; ".join(f"worker for device {d} died" for d in sorted(dead))
            return self._lost_result(batches, why, dead, reset, ran=False)
        try:
            # Every rank of a batch's placement takes part; the last stage's first rank answers its tokens.
            devices = sorted({d for b in batches for d in self._model_devices(b.model)})
            workers = self._ranks(devices)
            for w in workers:
                w.start_step([b for b in batches if w.device in self._model_devices(b.model)])
        except WorkerDied as e:  # died since the check above: this step reports it
            return self._lost_step(batches, e, {e.device})
        answers = {self._answerer(b.model) for b in batches}
        result, lost, error, died = StepResult(), set(), None, None
        for w in workers:  # read on this thread: the step's answers never wait for another thread
            try:
                part = w.finish_step(self.call_timeout)
            except WorkerDied as e:  # a worker killed for a restart of the world names the one that died
                lost.add(e.device)
                died = died or e
                self._on_death(w, e)  # at once (its receiver thread may not have seen it yet)
                continue
            except Exception as e:
                error = error or e
                continue
            for name, sec in part.loaded.items():  # a sharded model's load took its slowest rank's time
                result.loaded[name] = max(sec, result.loaded.get(name, 0.0))
                self.rank_loads.setdefault(name, {})[w.device] = sec
            if w.device in answers:
                for field in ("tokens", "logprobs", "prompt_logprobs", "compute_s", "failed", "trace"):
                    getattr(result, field).update(getattr(part, field))
                result.lost_devices.extend(part.lost_devices)
        if died is not None:  # a rank of the step died (another's error is then most likely its echo)
            return self._lost_step(batches, died, lost)
        if error is not None:
            raise error
        return result

    def wait_loads(self) -> dict[str, float]:
        """Seconds of each load that ended: its slowest rank's."""
        out: dict[str, float] = {}
        for d, part in zip(self.devices, self._broadcast_all(self.devices, "wait_loads")):
            for name, sec in part.items():
                out[name] = max(sec, out.get(name, 0.0))
                self.rank_loads.setdefault(name, {})[d] = sec
        return out

    def free(self, req_ids: list[str]) -> None:
        """No reply awaited (messages are served in order). A worker that is gone or restarting
        took its KV caches with it: nothing to free there."""
        for d in self.devices:
            if self._ready[d].is_set() and d not in self._broken:
                self._workers[d].send("free", req_ids)

    def status(self) -> ExecutorStatus:
        """Does not wait for a restart under way: a restarting worker holds nothing (its devices as
        last seen, empty), so a core repairing residency after a failed swap is not held up."""
        parts = []
        for d in self.devices:
            last = self._last_status.get(d)
            if last is not None and (not self._ready[d].is_set() or d in self._broken):
                parts.append(ExecutorStatus([dataclasses.replace(dev, weights=0, kv=0) for dev in last.devices], {},
                                            last.kv_block_tokens, {}))
                continue
            w = self._worker(d)
            try:
                parts.append(self._wait(w.call("status"), d, "status"))
            except WorkerDied:
                return self.status()  # it died just now: answer as for a restart under way
            self._last_status[d] = parts[-1]
        devices = [dataclasses.replace(dev, index=d) for d, st in zip(self.devices, parts) for dev in st.devices]
        models: dict[str, str] = {}
        for st in parts:  # a model is resident when every rank is; loading while any is
            for name, s in st.models.items():
                models[name] = "loading" if models.get(name) == "loading" else s
        stats = {"restarts": self.restarts}
        for st in parts:
            for k, v in st.stats.items():
                stats[k] = stats.get(k, 0) + v
        return ExecutorStatus(devices, models, parts[0].kv_block_tokens, stats)

    def resize(self, device: int, nbytes: int) -> int:
        """The arena of that device's worker (a restarted worker starts at its full size again)."""
        if device not in self.devices:
            raise ValueError(f"no device {device}; devices: {list(self.devices)}")
        return self._broadcast([device], "resize", device, nbytes)

    def probe_link(self, name: str, repeats: int) -> list[float]:
        """Every rank copies its own shard's bytes at once; each repeat takes its slowest rank's time."""
        parts = self._broadcast_all(self._model_devices(name), "probe_link", name, repeats)
        return [max(times) for times in zip(*parts)]

    def weights_digest(self, name: str) -> list[str]:
        """Per rank, a digest of the model's weights on its device, once its copies ended (tests, operators)."""
        return self._broadcast_all(self._model_devices(name), "weights_digest", name)

    def image_digest(self, name: str) -> list[str]:
        """Per rank, a digest of the model's host image (what ``weights_digest`` must give after a load)."""
        return self._broadcast_all(self._model_devices(name), "image_digest", name)

    def worker_pids(self) -> dict[int, int]:
        """The worker process of each device (for operators and tests)."""
        return {d: self._worker(d).pid for d in self.devices}

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            restarts = list(self._restarts)
        for t in restarts:
            t.join(self.start_timeout)
        # device 0's worker hosts the process group's store: stopped last, so no other rank's NCCL
        # watchdog is left polling a store that has gone (a burst of broken-pipe warnings at exit)
        for _, w in sorted(self._workers.items(), reverse=True):
            w.stop()
        remove_images(os.getpid())  # those of workers that could not remove their own
        if self._nodes is not None:
            self._nodes.close()


__all__ = ["WorkerExecutor", "WorkerDied"]
