"""The memory arbiter: per GPU, how many bytes inference and training may each hold.

Pure logic (no torch, no I/O, an injected clock), driven by events and answering with actions:

- events: training joins (with the least it can run in) or leaves; inference asks for a total
  share (``demand``), reports activity, confirms it gave bytes back; training acknowledges a new
  limit; the clock ticks;
- actions: :class:`TrainLimit` (training must fit in ``bytes``: 0 means pause and free
  everything; ``immediate`` says whether to abandon the running micro-batch) and
  :class:`InferenceShare` (the inference engine's new budget on that device).

Shares are handed over, never double-booked: a share that shrinks counts at its old size until
its holder acknowledges, one that grows counts at its new size as soon as it is sent, so
``inference + training <= capacity`` holds at every instant (except in ``normal`` mode, which
coordinates nothing). Modes (as in Sirius' server):

- ``normal``: each side believes it owns the whole device; no messages after training joins.
- ``static``: a fixed split; training holds ``static_train`` bytes, inference the rest.
- ``task-switch``: while inference has work training is paused (limit 0) and inference may use the
  whole device; after ``idle_s`` without inference work, memory goes back and training resumes.
- ``colocate``: training shrinks (its micro-batch) to free exactly what inference needs; a
  limit below training's minimum pauses it. Memory goes back after ``idle_s`` of inference idle,
  as much as training can use: a job that says the most it can use (``train_most``: its largest
  micro-batch's predicted peak, with a little slack) is never given more, and idle inference keeps
  the rest, so its models stay resident instead of being evicted for memory nobody uses.

Compute is shared as memory is not: without MPS two processes on one GPU take turns in time
slices, and inference's short kernels wait behind training's. ``yield_compute`` (``static`` and
``colocate``) has training yield the GPU's compute to inference: ``work`` while inference has
any work, ``first-token`` only while a request waits for its first token (its swap-in, its
prefill; decode steps share the GPU), ``cold`` only while a request that found its model off the
device waits for its first token (the swap-in, the first prefill and graph captures after it are
where colocated requests miss their SLO; a warm request's first token is quick), ``none`` never.
:class:`TrainYield` ``on`` when inference reports such work (``busy``), ``off`` as soon as it has
none (``busy`` without it, ``quiet``, or no ``busy`` for ``YIELD_STALE_S``: a request cancelled
between steps leaves no step to report it); training stops queuing kernels at its next watched
point until then (``client.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("normal", "static", "task-switch", "colocate")
YIELDS = ("none", "cold", "first-token", "work")  # when training yields the compute to inference
YIELD_STALE_S = 0.25  # a yield with no ``busy`` this long ends (inference reports busy before every step)


@dataclass(frozen=True)
class TrainLimit:
    device: int
    bytes: int
    immediate: bool
    id: int


@dataclass(frozen=True)
class TrainYield:
    device: int
    on: bool  # True: stop queuing GPU work until told False (memory is not touched)


@dataclass(frozen=True)
class InferenceShare:
    device: int
    bytes: int


@dataclass(frozen=True)
class ArbiterConfig:
    mode: str
    capacity: int  # bytes per device that inference and training share
    static_train: int = 0  # static: training's fixed share
    idle_s: float = 1.0  # inference idle this long before its memory goes back to training
    infer_floor: int = 0  # what inference keeps when idle (e.g. models it keeps warm)
    immediate: bool = True  # abandon the running micro-batch (else: release at the next boundary)
    yield_compute: str = "none"  # static, colocate: when training yields the GPU's compute (YIELDS)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown colocation mode {self.mode!r}; known: {', '.join(MODES)}")
        if self.capacity <= 0:
            raise ValueError(f"capacity must be positive, got {self.capacity}")
        if not 0 <= self.static_train <= self.capacity:
            raise ValueError(f"static_train must be within 0..capacity ({self.capacity}), got {self.static_train}")
        if not 0 <= self.infer_floor <= self.capacity:
            raise ValueError(f"infer_floor must be within 0..capacity ({self.capacity}), got {self.infer_floor}")
        if self.idle_s < 0:
            raise ValueError(f"idle_s must be >= 0, got {self.idle_s}")
        if self.yield_compute not in YIELDS:
            raise ValueError(f"unknown yield_compute {self.yield_compute!r}; known: {', '.join(YIELDS)}")


@dataclass
class _Device:
    infer: int = 0  # inference's share (counts its old size while a reduction is unconfirmed)
    train: int = 0  # training's share (counts its old size while a shrink is unacknowledged)
    infer_target: int | None = None  # a reduction of inference's share awaiting confirmation
    train_sent: int | None = None  # the limit sent to training, not yet acknowledged
    sent_id: int = 0
    wanted: int = 0  # inference's latest demand
    last_busy: float = float("-inf")
    joined: bool = False
    train_min: int = 0
    train_max: int = 0  # the most training can use (colocate caps its limit there); 0: unknown, no cap
    yielding: bool = False  # training was told to yield the compute


class Arbiter:
    def __init__(self, config: ArbiterConfig, devices: int = 1):
        self.config = config
        self.devices = [_Device() for _ in range(devices)]
        self._next_id = 0

    # ---- what each side may hold -------------------------------------------------------------

    def shares(self, device: int) -> tuple[int, int]:
        """(inference, training) bytes currently booked on ``device``."""
        d = self.devices[device]
        return d.infer, d.train

    def pending(self, device: int) -> bool:
        """A limit or a reduction is in flight on ``device``."""
        d = self.devices[device]
        return d.train_sent is not None or d.infer_target is not None

    # ---- events ------------------------------------------------------------------------------

    def train_joined(self, device: int, min_bytes: int, now: float, max_bytes: int = 0) -> list:
        """Training connects (or reconnects); it runs in no less than ``min_bytes`` (0: any) and uses no
        more than ``max_bytes`` (0: unknown; ``train_most``)."""
        c, d = self.config, self.devices[device]
        d.joined, d.train_min, d.train, d.train_sent = True, max(0, min_bytes), 0, None
        d.train_max = max(0, max_bytes)
        d.yielding = False  # a new connection starts running; inference's next ``busy`` says otherwise
        if c.mode == "normal":
            return [self._send(device, c.capacity)]
        if c.mode == "static":
            return [self._send(device, c.static_train)]
        if c.mode == "task-switch" and now - d.last_busy < c.idle_s:
            return [self._send(device, 0)]
        return [self._send(device, self._fit(d, c.capacity - d.infer))]

    def train_most(self, device: int, max_bytes: int, now: float) -> list:
        """Training can use at most ``max_bytes`` on ``device`` (0: unknown): in ``colocate`` its limit
        is never more. A limit above it comes down to it (nothing to free: acknowledged at once, and
        inference may then have the rest while idle); one below it grows into the memory that is free."""
        c, d = self.config, self.devices[device]
        if max_bytes < 0:
            raise ValueError(f"training's most must be >= 0 bytes, got {max_bytes}")
        d.train_max = max_bytes
        if c.mode != "colocate" or not d.joined or self.pending(device):
            return []
        limit = self._fit(d, c.capacity - d.infer)  # memory inference holds stays with it
        return [self._send(device, limit)] if limit != d.train else []

    def train_left(self, device: int, now: float) -> list:
        """Training disconnected (finished or died): its share is free at once."""
        d = self.devices[device]
        d.joined, d.train, d.train_sent, d.yielding = False, 0, None, False
        return self._grant(device)

    def demand(self, device: int, nbytes: int, now: float) -> list:
        """Inference needs ``nbytes`` in all on ``device`` (weights, KV, workspace); it is busy now."""
        c, d = self.config, self.devices[device]
        if nbytes < 0:
            raise ValueError(f"a demand must be >= 0 bytes, got {nbytes}")
        d.wanted, d.last_busy = min(nbytes, c.capacity), now
        if c.mode == "normal":
            d.infer = d.wanted
            return [InferenceShare(device, d.wanted)]
        if c.mode == "static":
            return self._grant(device)
        out = []
        if d.infer_target is not None and d.wanted > d.infer_target:  # idle reduction overtaken by work
            d.infer_target = None
            out.append(InferenceShare(device, d.infer))  # inference keeps what it held
        free = c.capacity - d.infer - self._train_booked(d)
        if c.mode == "task-switch":  # training pauses whenever inference has work
            if d.joined and self._train_target(d) > 0:
                out.append(self._send(device, 0))
        elif d.wanted > d.infer + max(0, free) and d.joined:
            limit = self._fit(d, c.capacity - d.wanted)
            if limit < self._train_target(d):
                out.append(self._send(device, limit))
        return out + self._grant(device)

    def busy(self, device: int, now: float, first_token: bool = True) -> list:
        """Inference has work at ``now`` (``first_token``: a request waits for its first token, one that
        found its model cold under ``cold``): keeps its memory from going back and, as ``yield_compute``
        says, has training yield the compute or not."""
        c, d = self.config, self.devices[device]
        d.last_busy = now
        want = d.joined and c.mode in ("static", "colocate") and (
            c.yield_compute == "work" or c.yield_compute in ("first-token", "cold") and first_token)
        if want == d.yielding:
            return []
        d.yielding = want
        return [TrainYield(device, want)]

    def quiet(self, device: int, now: float) -> list:
        """Inference has no work on ``device`` at ``now``: training may use the compute again."""
        d = self.devices[device]
        if not d.yielding:
            return []
        d.yielding = False
        return [TrainYield(device, False)]

    def train_ack(self, device: int, id: int, train_bytes: int, now: float) -> list:
        """Training fits in ``train_bytes`` now, in answer to limit ``id`` (older answers are ignored)."""
        c, d = self.config, self.devices[device]
        if id != d.sent_id or d.train_sent is None:
            return []
        d.train, d.train_sent = min(train_bytes, d.train_sent) if c.mode != "normal" else train_bytes, None
        out = self._grant(device)
        if c.mode == "colocate" and d.train_max and d.train > d.train_max and not self.pending(device):
            out.append(self._send(device, self._fit(d, c.capacity - d.infer)))  # it said it uses less since
        return out

    def inference_released(self, device: int, now: float) -> list:
        """Inference fits in the reduced share it was sent."""
        c, d = self.config, self.devices[device]
        if d.infer_target is None:
            return []
        d.infer, d.infer_target = d.infer_target, None
        if not d.joined or c.mode in ("normal", "static"):
            return []
        return [self._send(device, self._fit(d, c.capacity - d.infer))]

    def tick(self, now: float) -> list:
        """Memory goes back to training on devices whose inference has been idle ``idle_s``; a yield
        that inference stopped reporting ends."""
        c, out = self.config, []
        for i, d in enumerate(self.devices):
            if d.yielding and now - d.last_busy >= YIELD_STALE_S:
                out += self.quiet(i, now)
        if c.mode not in ("task-switch", "colocate"):
            return out
        for i, d in enumerate(self.devices):
            idle = now - d.last_busy >= c.idle_s
            keep = self._idle_share(d)
            if idle and d.joined and d.infer > keep and d.infer_target is None and d.train_sent is None:
                d.infer_target = keep
                out.append(InferenceShare(i, keep))
            elif idle and d.joined and d.train_sent is None and d.infer_target is None:
                grow = self._fit(d, c.capacity - d.infer)
                if grow > d.train:
                    out.append(self._send(i, grow))
                elif d.infer < keep <= c.capacity - self._train_booked(d):  # what training cannot use
                    d.infer = keep
                    out.append(InferenceShare(i, keep))
        return out

    def settled(self, device: int) -> bool:
        """Both sides hold what they hold while inference is idle: nothing in flight, inference at its
        idle share, training at all it may use."""
        c, d = self.config, self.devices[device]
        return (not self.pending(device) and d.infer == self._idle_share(d)
                and d.train == self._fit(d, c.capacity - d.infer))

    # ---- internals ---------------------------------------------------------------------------

    def _fit(self, d: _Device, room: int) -> int:
        """Training's limit in ``room`` bytes: all of it (in ``colocate`` no more than it can use), or 0
        (paused) below its minimum."""
        if room < max(1, d.train_min):
            return 0
        return min(room, d.train_max) if d.train_max and self.config.mode == "colocate" else room

    def _idle_share(self, d: _Device) -> int:
        """What idle inference keeps: its floor, and in ``colocate`` what training cannot use."""
        if d.train_max and self.config.mode == "colocate":
            return max(self.config.infer_floor, self.config.capacity - d.train_max)
        return self.config.infer_floor

    def _train_target(self, d: _Device) -> int:
        return d.train if d.train_sent is None else d.train_sent

    def _train_booked(self, d: _Device) -> int:
        return d.train if d.train_sent is None else max(d.train, d.train_sent)

    def _send(self, device: int, limit: int) -> TrainLimit:
        d = self.devices[device]
        self._next_id += 1
        d.sent_id, d.train_sent = self._next_id, limit
        if limit > d.train or self.config.mode == "normal":
            d.train = limit  # a growing share counts at once
        return TrainLimit(device, limit, self.config.immediate, self._next_id)

    def _grant(self, device: int) -> list:
        """Give inference what it wants, as far as the free bytes allow (never less than it holds)."""
        c, d = self.config, self.devices[device]
        if c.mode == "normal":
            return []
        room = c.capacity - (c.static_train if c.mode == "static" else self._train_booked(d))
        if c.mode == "task-switch" and d.wanted > 0 and d.train_sent is None and d.train == 0:
            want = room  # inference owns the whole device while training is paused
        else:
            want = d.wanted
        new = min(want, room)
        if new > d.infer and (d.infer_target is None):
            d.infer = new
            return [InferenceShare(device, new)]
        return []
