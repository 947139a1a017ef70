"""The parent's end of one worker: ``_Worker``, a proxy that sends the protocol's calls and resolves
their answers on a receiver thread of its own (see ``worker_loop`` for the messages).

A worker of this node is a process of ours (``spawn``); a worker of another node is an accepted,
authenticated connection (``workers_remote``). ``WorkerExecutor`` (``workers.py``) holds one
``_Worker`` per device. Exceptions raised in a worker come back by type name and message and are
rebuilt here (``_remote_error``); a worker that dies or whose connection closes is ``WorkerDied``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import wait as mp_wait
from typing import Callable

from ..messages import StepResult
from .worker_loop import BASES, worker_main
from .workers_remote import hang_up

log = logging.getLogger("computron.workers")

POLL_S = 0.5  # the receiver's wait on pipe + sentinel; a death is noticed within this (usually at once)
_remote_types: dict[tuple[str, str], type] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class WorkerDied(RuntimeError):
    def __init__(self, device: int, exitcode: int | None, where: str | None = None):
        self.device, self.exitcode = device, exitcode
        super().__init__(f"worker for device {device} died (exit code {exitcode})" if where is None else
                         f"worker for device {device} on {where} is gone (its connection to the engine closed)")


def _remote_error(tname: str, bname: str, msg: str) -> BaseException:
    """The worker's exception again: the project's own error types as themselves, others as a
    subclass of the nearest built-in base under their own name."""
    from ..models.checkpoint import CheckpointError

    known = {"CheckpointError": CheckpointError}
    if tname in known:
        return known[tname](msg)
    base = next((b for b in BASES if b.__name__ == bname), RuntimeError)
    if tname == base.__name__:
        return base(msg)
    key = (tname, bname)
    if key not in _remote_types:
        _remote_types[key] = type(tname, (base,), {"__module__": __name__})
    return _remote_types[key](msg)


class _Worker:
    """One worker, the parent's end of its connection, and a receiver thread that resolves replies.

    A worker of this node is a process of ours (``spawn``): its step answers come on a pipe of their
    own and its death shows on its process sentinel. A worker of another node (``where``: its host)
    is reached over one authenticated TCP connection, which also carries its step answers (handed
    over by the receiver thread); its death shows as the connection closing."""

    def __init__(self, device: int, on_death: Callable[["_Worker"], None], conn, steps=None, proc=None,
                 pid: int | None = None, where: str | None = None):
        self.device, self.on_death, self.conn, self.steps, self.proc = device, on_death, conn, steps, proc
        self.pid, self.where = (proc.pid if proc is not None else pid), where
        self._replies: queue.SimpleQueue | None = queue.SimpleQueue() if steps is None else None
        self.dead: WorkerDied | None = None
        self.closing = False
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # sends and the table of calls in flight
        self._reaping = threading.Lock()
        self._pending: dict[int, tuple[Future, Callable | None]] = {0: (Future(), None)}
        self._started = self._pending[0][0]
        self._thread = threading.Thread(target=self._receive, name=f"computron-worker-{device}-rx", daemon=True)
        self._thread.start()

    @classmethod
    def spawn(cls, ctx, config, device: int, on_death, world: int = 1, port: int = 0,
              master: str = "127.0.0.1") -> "_Worker":
        """A worker process of this node."""
        parent, child = ctx.Pipe()
        steps, steps_child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=worker_main, args=(child, config, device, world, port, steps_child, master),
                           name=f"computron-worker-{device}", daemon=True)
        proc.start()
        child.close()  # only the worker holds that end: its death reads as EOF here
        steps_child.close()
        return cls(device, on_death, parent, steps, proc)

    def wait_started(self, timeout: float) -> None:
        try:
            self._started.result(timeout)
        except FutureTimeout:
            self.kill()
            raise RuntimeError(f"worker for device {self.device} did not start within {timeout:.0f} s") from None
        except BaseException:  # it said why and leaves; make sure it is gone
            self.closing = True
            if self.proc is not None:
                self.proc.join(5.0)
            self.kill()
            raise

    def call(self, name: str, *args, progress: Callable[[str], None] | None = None) -> Future:
        fut: Future = Future()
        with self._lock:
            if self.dead is not None:
                raise self.dead
            rid = next(self._ids)
            self._pending[rid] = (fut, progress)
            try:
                self.conn.send((rid, name, args))
            except (OSError, ValueError) as e:  # broken pipe: the receiver will report the death
                del self._pending[rid]
                raise RuntimeError(f"worker for device {self.device} is gone: {e}") from None
        return fut

    def start_step(self, batches: list) -> None:
        """Send a step; its answer comes on the steps pipe (``finish_step``)."""
        with self._lock:
            if self.dead is not None:
                raise self.dead
            try:
                self.conn.send((None, "step", (batches,)))
            except (OSError, ValueError):
                raise self._death() from None

    def finish_step(self, timeout: float) -> StepResult:
        """The step's answer, read on the calling thread (for a worker of another node: handed over by
        the receiver); WorkerDied if the worker died meanwhile."""
        waited = 0.0
        while True:
            if self._replies is not None:
                try:
                    reply = self._replies.get(timeout=POLL_S)
                except queue.Empty:
                    reply = None
                else:
                    if reply is None:  # the receiver found the connection closed
                        raise self._death()
            else:
                ready = mp_wait([self.steps, self.proc.sentinel], POLL_S)
                reply = None
                if self.steps in ready:
                    try:
                        reply = self.steps.recv()
                    except (EOFError, OSError):
                        raise self._death() from None
                elif ready:
                    raise self._death()
            if reply is not None:
                if reply[0] == "ok":
                    return reply[1]
                raise _remote_error(*reply[1:4])
            waited += POLL_S
            if waited >= timeout:
                raise RuntimeError(f"worker for device {self.device} did not answer a step within {timeout:.0f} s")

    def _death(self) -> WorkerDied:
        if self.proc is not None:
            # It is going (its pipe closed or its sentinel fired). One thread at a time reaps it: a second
            # waitpid of the same process fails and would read its exit code as None.
            with self._reaping:
                self.proc.join(5.0)
        return self.dead or WorkerDied(self.device, self.proc.exitcode if self.proc is not None else None,
                                       self.where)

    def send(self, name: str, *args) -> bool:
        """A call without reply (its errors are logged by the worker); False if the worker is gone."""
        with self._lock:
            if self.dead is not None:
                return False
            try:
                self.conn.send((None, name, args))
                return True
            except (OSError, ValueError):
                return False

    def _receive(self) -> None:
        waitables = [self.conn] + ([self.proc.sentinel] if self.proc is not None else [])
        while True:
            try:
                ready = mp_wait(waitables, POLL_S)
            except (OSError, ValueError):  # the connection was closed under us (killed)
                return self._died()
            if self.conn in ready:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError, ValueError):
                    return self._died()
                self._deliver(msg)
            elif ready:  # the sentinel alone: the process ended and nothing is left to read
                return self._died()

    def _deliver(self, msg: tuple) -> None:
        rid, kind = msg[0], msg[1]
        if kind == "step":  # a step's answer from a worker of another node
            self._replies.put(msg[2])
            return
        with self._lock:
            entry = self._pending.get(rid) if kind == "progress" else self._pending.pop(rid, None)
        if entry is None:
            return
        fut, progress = entry
        if kind == "progress":
            if progress is not None:
                try:
                    progress(msg[2])
                except Exception:  # a caller's callback must not stop the receiver
                    log.exception("progress callback failed")
        elif kind == "ok":
            fut.set_result(msg[2])
        else:
            fut.set_exception(_remote_error(*msg[2:5]))

    def _died(self) -> None:
        death = self._death()
        with self._lock:  # a worker we killed keeps the reason it was killed for
            self.dead = self.dead or death
            pending, self._pending = self._pending, {}
        if self._replies is not None:
            self._replies.put(None)
        if not self.closing:
            log.error("%s", self.dead)
            self.on_death(self)  # before failing the calls: their callbacks see the restart under way
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(self.dead)
        try:
            self.conn.close()
        except OSError:
            pass

    def stop(self, timeout: float = 10.0) -> None:
        self.closing = True
        try:
            self.call("shutdown").result(timeout)
        except Exception:
            pass
        if self.proc is not None:
            self.proc.join(timeout)
        self.kill()
        self._thread.join(timeout)

    def kill(self, cause: WorkerDied | None = None) -> None:
        """End the worker now (a worker of another node: close its connection, which ends it); with a
        ``cause``, its calls and step in flight fail with that."""
        self.closing = True
        if cause is not None:
            with self._lock:
                self.dead = self.dead or cause
        if self.proc is None:
            hang_up(self.conn)
            return
        with self._reaping:
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5.0)
