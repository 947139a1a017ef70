"""The handover between processes: JSON lines over a Unix or TCP socket, a message and an ack.

Server side (the inference process): :class:`ArbiterServer` wraps an :class:`Arbiter`, accepts
training jobs (one per device), and is what the inference engine calls:
``share = server.demand(device, nbytes)`` blocks until inference may hold ``nbytes`` on that
device and returns the handover's timing; ``on_share`` is called with every new inference
budget (the engine sets its scheduler's budget and evicts down to it before returning, or
answers False and calls ``released(device)`` once it has, from its own thread).

Training side: :class:`~computron.colocate.client.Colocation` (``client.py``).

Messages (one JSON object a line; times are ``time.monotonic()``, one clock for all the
processes of a machine): training → server ``hello{device, min_bytes, max_bytes}``, ``ack{id,
bytes, received, reached, drained, released, at}``, ``most{bytes}`` (the most it can use, when that changes); server →
training ``limit{id, bytes, immediate, sent}`` and, with ``yield_compute``, ``yield{on, sent}``
(stop or go on queuing GPU work; nothing to acknowledge). A training job
that disconnects (finished or killed) gives its share back at once; a server that restarts is
found again by the job, which keeps its last limit meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import deque

from .arbiter import Arbiter, InferenceShare, TrainLimit, TrainYield

log = logging.getLogger("computron.colocate")
RECORDS = 100_000  # records of each kind a server keeps (handovers, limits, share changes)


def family(address: str):
    if ":" in address and not address.startswith(("/", ".")):
        host, port = address.rsplit(":", 1)
        return socket.AF_INET, (host, int(port))
    return socket.AF_UNIX, address


def listen(address: str) -> socket.socket:
    fam, addr = family(address)
    if fam == socket.AF_UNIX and os.path.exists(addr):
        os.unlink(addr)  # a previous server's socket file
    s = socket.socket(fam, socket.SOCK_STREAM)
    if fam == socket.AF_INET:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(addr)
    s.listen(8)
    return s


def connect(address: str, timeout: float | None = None) -> socket.socket:
    fam, addr = family(address)
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(addr)
    s.settimeout(None)
    if fam == socket.AF_INET:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


class Channel:
    """One JSON object a line in each direction; ``send`` is thread-safe."""

    def __init__(self, sock: socket.socket):
        self.sock, self._lock = sock, threading.Lock()
        self._file = sock.makefile("rb")

    def send(self, msg: dict) -> bool:
        data = (json.dumps(msg) + "\n").encode()
        try:
            with self._lock:
                self.sock.sendall(data)
            return True
        except OSError:
            return False

    def recv(self) -> dict | None:
        """The next message, or None when the peer is gone."""
        try:
            line = self._file.readline()
        except (OSError, ValueError):
            return None
        if not line:
            return None
        try:
            return json.loads(line)
        except ValueError:
            return None  # a broken peer: treated as gone

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class ArbiterServer:
    def __init__(self, arbiter: Arbiter, address: str, on_share=None, tick_s: float = 0.01):
        self.arbiter, self.address = arbiter, address
        self.on_share = on_share  # called with (device, bytes): the engine's new budget
        self.budgets = [0] * len(arbiter.devices)  # inference's budget per device, as last applied
        # the latest RECORDS of each (a server runs for long): one per demand that had to wait for
        # training; (time, device, bytes) of every limit sent to training; (time, device, inference,
        # training) whenever the shares change
        self.handovers: deque[dict] = deque(maxlen=RECORDS)
        self.limits: deque[tuple[float, int, int]] = deque(maxlen=RECORDS)
        self.timeline: deque[tuple[float, int, int, int]] = deque(maxlen=RECORDS)
        self.yields: deque[tuple[float, int, bool]] = deque(maxlen=RECORDS)  # (time, device, on) of each sent
        # (time, device, bytes) of each most a job said it can use (its hello's, then each change)
        self.mosts: deque[tuple[float, int, int]] = deque(maxlen=RECORDS)
        self._last_shares: dict[int, tuple[int, int]] = {}
        self._lock = threading.Condition()
        self._trainers: dict[int, Channel] = {}
        self._sent: dict[int, tuple[float, int]] = {}  # id -> (sent time, device)
        self._acks: dict[int, dict] = {}
        self._closed = False
        self._listener = listen(address)
        fam, path = family(address)
        self._socket_file = os.stat(path).st_ino if fam == socket.AF_UNIX else None
        self._threads = [threading.Thread(target=self._accept, daemon=True),
                         threading.Thread(target=self._ticker, args=(tick_s,), daemon=True)]
        for t in self._threads:
            t.start()

    # ---- what the inference engine calls -----------------------------------------------------

    def demand(self, device: int, nbytes: int, timeout: float | None = None) -> dict:
        """Block until inference's budget on ``device`` is at least ``nbytes``; the handover's timing.

        Returns ``{"t", "wait_s", "signal_s", "release_s", "reach_s", "drain_s", "empty_s", "ack_s", "granted",
        "alloc_s", "swap_s", "free_s", "at"}`` (``t``: when it was asked; ``at``: where the job's loop was when
        the order came, ``Colocation._ack``; ``release_s``, training's part, is
        ``reach_s``, until its loop reached the release, plus ``drain_s``, until the GPU work it had queued
        was done, plus ``empty_s``, the release itself (the allocator's cache emptied, or the state
        parked); the parts are None when no training memory had to move; the
        engine fills ``alloc_s``, ``swap_s`` and ``free_s`` in, see ``serving.EngineLink``). Raises TimeoutError
        after ``timeout`` seconds.
        """
        t0 = time.monotonic()
        with self._lock:
            first_id = max(self._sent, default=0)
            self._dispatch(self.arbiter.demand(device, nbytes, t0))
            ok = self._lock.wait_for(lambda: self.budgets[device] >= min(nbytes, self.arbiter.config.capacity)
                                     or self.arbiter.config.mode == "static" and not self.arbiter.pending(device),
                                     timeout)
            if not ok:
                raise TimeoutError(f"inference did not get {nbytes} bytes on device {device} within {timeout} s")
            t1 = time.monotonic()
            acks = [a for i, a in self._acks.items() if i > first_id and a["device"] == device]
        rec = {"t": t0, "device": device, "bytes": nbytes, "wait_s": t1 - t0, "granted": self.budgets[device],
               "signal_s": None, "release_s": None, "reach_s": None, "drain_s": None, "empty_s": None, "ack_s": None,
               "alloc_s": None, "swap_s": None, "free_s": None, "at": None}
        if acks:
            a = acks[-1]
            reached, drained = a["reached"], a["drained"]
            rec.update(at=a["at"], signal_s=a["received"] - a["sent"], release_s=a["released"] - a["received"],
                       reach_s=reached - a["received"], drain_s=drained - reached, empty_s=a["released"] - drained,
                       ack_s=a["arrived"] - a["released"])
            self.handovers.append(rec)
        return rec

    def released(self, device: int) -> None:
        """The engine fits in a reduced budget now (after an ``on_share`` that answered False)."""
        with self._lock:
            self._dispatch(self.arbiter.inference_released(device, time.monotonic()))

    def busy(self, device: int, first_token: bool = True) -> None:
        """Inference has work on ``device`` now (``first_token``: a request waits for its first token)."""
        with self._lock:
            self._dispatch(self.arbiter.busy(device, time.monotonic(), first_token))

    def quiet(self, device: int) -> None:
        """Inference has no work on ``device`` now."""
        with self._lock:
            self._dispatch(self.arbiter.quiet(device, time.monotonic()))

    def records(self, since: float | None = None) -> dict:
        """What happened since ``since`` (a ``time.monotonic()``; None: everything), as plain JSON:
        the current shares, the handovers, the limits sent to training, the share timeline, the
        yields (``[time, device, on]``) and the mosts the jobs said they can use (``[time, device, bytes]``)."""
        def kept(rows, t=lambda r: r[0]):
            return [r for r in rows if since is None or t(r) >= since]

        with self._lock:
            return {"shares": [list(self.arbiter.shares(d)) for d in range(len(self.arbiter.devices))],
                    "settled": [self.arbiter.settled(d) for d in range(len(self.arbiter.devices))],
                    "trainers": sorted(self._trainers), "handovers": [dict(h) for h in kept(self.handovers,
                                                                                      lambda h: h["t"])],
                    "limits": [list(r) for r in kept(self.limits)], "timeline": [list(r) for r in kept(self.timeline)],
                    "yields": [list(r) for r in kept(self.yields)], "mosts": [list(r) for r in kept(self.mosts)]}

    def trainer_connected(self, device: int) -> bool:
        with self._lock:
            return device in self._trainers

    def close(self) -> None:
        """Stop listening and drop the jobs (they keep their last limit and look for the next server)."""
        self._closed = True
        try:  # wakes the accepting thread: closing alone leaves it accepting on the same socket
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        _, path = family(self.address)
        try:
            if self._socket_file is not None and os.stat(path).st_ino == self._socket_file:
                os.unlink(path)  # this server's socket file (not one a newer server made at the same path)
        except OSError:
            pass
        with self._lock:
            for ch in self._trainers.values():
                ch.close()

    # ---- internals ---------------------------------------------------------------------------

    def _dispatch(self, actions) -> None:
        """Carry out the arbiter's actions (the lock is held)."""
        while actions:
            a = actions.pop(0)
            if isinstance(a, TrainLimit):
                ch = self._trainers.get(a.device)
                now = time.monotonic()
                self._sent[a.id] = (now, a.device)
                self.limits.append((now, a.device, a.bytes))
                if ch is None or not ch.send({"t": "limit", "id": a.id, "bytes": a.bytes,
                                              "immediate": a.immediate, "sent": now}):
                    actions += self.arbiter.train_left(a.device, now)
            elif isinstance(a, TrainYield):
                ch, now = self._trainers.get(a.device), time.monotonic()
                if ch is not None and ch.send({"t": "yield", "on": a.on, "sent": now}):
                    self.yields.append((now, a.device, a.on))
            elif isinstance(a, InferenceShare):
                shrink = a.bytes < self.budgets[a.device]
                fitted = True if self.on_share is None else self.on_share(a.device, a.bytes) is not False
                self.budgets[a.device] = a.bytes
                if shrink and fitted:  # else the engine calls released() once it fits
                    actions += self.arbiter.inference_released(a.device, time.monotonic())
        for d in range(len(self.arbiter.devices)):
            shares = self.arbiter.shares(d)
            if self._last_shares.get(d) != shares:
                self._last_shares[d] = shares
                self.timeline.append((time.monotonic(), d, *shares))
        self._lock.notify_all()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            if self._closed:
                sock.close()
                return
            threading.Thread(target=self._serve, args=(Channel(sock),), daemon=True).start()

    def _serve(self, ch: Channel) -> None:
        hello = ch.recv()
        if not hello or hello.get("t") != "hello":
            ch.close()
            return
        try:
            device, least, most = (int(hello.get(k, 0)) for k in ("device", "min_bytes", "max_bytes"))
        except (TypeError, ValueError):
            ch.send({"t": "error",
                     "error": f"a hello needs whole numbers of device, min_bytes, max_bytes, got {hello}"})
            ch.close()
            return
        with self._lock:
            if device in self._trainers or not 0 <= device < len(self.arbiter.devices):
                ch.send({"t": "error", "error": f"device {device} is taken or unknown"})
                ch.close()
                return
            self._trainers[device] = ch
            now = time.monotonic()
            self.mosts.append((now, device, most))
            self._dispatch(self.arbiter.train_joined(device, least, now, most))
        try:
            while (msg := ch.recv()) is not None:
                self._handle(device, msg)
        except (KeyError, TypeError, ValueError) as e:  # a broken job: treated as gone, its share freed
            log.warning("training job on device %d sent a message the arbiter cannot take (%r: %s); "
                        "dropping it", device, msg, e)
        with self._lock:
            if self._trainers.get(device) is ch:
                del self._trainers[device]
                self._dispatch(self.arbiter.train_left(device, time.monotonic()))
        ch.close()

    def _handle(self, device: int, msg: dict) -> None:
        """One message of the training job on ``device``."""
        if msg.get("t") == "most":
            with self._lock:
                now, nbytes = time.monotonic(), int(msg["bytes"])
                actions = self.arbiter.train_most(device, nbytes, now)  # refuses a negative most
                self.mosts.append((now, device, nbytes))
                self._dispatch(actions)
        elif msg.get("t") == "ack":
            with self._lock:
                sent = self._sent.get(msg["id"])
                if sent is not None:
                    self._acks[msg["id"]] = dict(device=device, sent=sent[0], received=msg["received"],
                                                 # an older client sends no "reached" or "drained"
                                                 reached=(r := msg.get("reached", msg["received"])),
                                                 drained=msg.get("drained", r),
                                                 released=msg["released"], arrived=time.monotonic(),
                                                 at=msg.get("at"))
                self._dispatch(self.arbiter.train_ack(device, msg["id"], int(msg["bytes"]), time.monotonic()))

    def _ticker(self, tick_s: float) -> None:
        while not self._closed:
            time.sleep(tick_s)
            with self._lock:
                self._dispatch(self.arbiter.tick(time.monotonic()))
