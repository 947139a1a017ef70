"""SimExecutor: the executor protocol over a virtual clock; no tensors, no torch.

It answers every call of ``engine/executor.py`` as the in-process executor would, but moves a
``VirtualClock`` by modelled times (``sim/costs.py``) instead of doing the work:

- ``register``: the model's config (presets and checkpoint directories through ``resolve_model``)
  and its image's bytes from the config alone (``sim/layout.py``, exactly the real layout);
- ``apply``: evictions take ``evict_s`` (+ ``evict_s_per_byte`` × bytes) each (an eviction of a
  model still loading first waits for its copies, as the real one synchronises); loads start now,
  or when the device's copy stream is free, and each layer group lands at ``start + bytes so far /
  bandwidth``;
- the legacy executor (the ``computron`` policy's) as it really is: its host copies are pageable
  until a model's first eviction (a load from them runs at ``pageable_swap_bandwidth``); each
  eviction copies the weights back into page-locked host memory that PyTorch allocates anew
  (``evict_pin_s_per_byte`` × bytes) unless a copy freed by an earlier eviction is cached for reuse
  (the model's previous page-locked copy is freed once the new one is made); its device weights
  live outside the arena, which holds only KV caches; and it captures no decode graphs;
- ``execute``: one token per sequence (a fixed id, never EOS) in a completed future; the clock
  moves to the end of the slowest batch (batches of one step run on disjoint devices at once;
  batches sharing a device, ``models_per_step`` > 1, take ``Calibration.together`` of their times). A
  cold batch computes layer group *i* once group *i* has landed, so compute overlaps the copy
  (the legacy executor of the ``computron`` policy blocks in ``apply`` until its load has landed,
  as its swap-in synchronises its load stream);
- ``status``: the arena's capacity per device (the same formula as the in-process executor, so
  the scheduler gets the same budgets), bytes of weights and KV blocks in use, and which models are
  loading or resident at the clock's time; ``wait_loads`` moves the clock to the end of every copy.

The KV cache is accounted per request in blocks, as the real arena allocates them, and an
allocation beyond the capacity raises (the scheduler was wrong), as the arena would.
"""

from __future__ import annotations

import math
from typing import Callable

from ..config import EngineConfig
from ..engine.buckets import bucket_of, buckets
from ..memory.units import arena_capacity, kv_region_bytes
from ..messages import (DeviceStatus, ExecuteBatch, ExecutorStatus, ModelDescription, ModelInfo, Placement,
                        Residency, StepResult)
from ..models import resolve_model
from .clock import VirtualClock
from .costs import CPU_DEFAULT, Calibration
from .timing import batch_time, pipelined_finish
from .layout import group_bytes


class _Done:
    """A step that has already run, as the future ``execute`` returns (``result()`` gives its
    ``StepResult`` or raises its error): a ``concurrent.futures.Future`` costs a lock and a
    condition per step, a tenth of the simulator's own work."""

    __slots__ = ("_value", "_error")

    def __init__(self, value=None, error: BaseException | None = None):
        self._value, self._error = value, error

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None):
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._error


class _Model:
    __slots__ = ("info", "device", "groups", "nbytes", "block_bytes", "token", "ready", "load_start",
                 "load_end", "reported", "kv_ready", "captured", "warmed", "pinned", "decode_s")

    def __init__(self, info: ModelInfo, groups: list[int], block_bytes: int, token: int):
        self.info, self.groups, self.block_bytes, self.token = info, groups, block_bytes, token
        self.device = info.placement.devices[0]
        self.nbytes = info.weight_bytes[0]
        self.ready: list[float] | None = None  # when each group lands (None: not on the device)
        self.load_start = self.load_end = 0.0
        self.reported = True  # its last load was reported to the core as ended
        self.kv_ready = 0.0  # when the last cache moved back from host memory for it has landed
        self.captured: set[int] = set()  # batch-size buckets whose decode graph was captured since its load
        self.warmed: set[int] = set()  # buckets ever captured (their kernels compiled and tuned): kept over loads
        self.pinned = False  # legacy executor: its host copy is page-locked (it was evicted once)
        self.decode_s: dict[int, float] = {}  # batch size -> seconds of one warm decode step (batch_time's)


class _Seq:
    """A request's KV cache on its model's device: blocks held (0 once freed or moved to host memory)."""

    __slots__ = ("model", "blocks")

    def __init__(self, model: _Model, blocks: int = 0):
        self.model, self.blocks = model, blocks


class SimExecutor:
    def __init__(self, config: EngineConfig | None = None, calibration: Calibration = CPU_DEFAULT,
                 clock: VirtualClock | None = None, devices: int = 1, token: int = 0):
        cfg = config or EngineConfig()
        self.config, self.cal = cfg, calibration
        self.clock = clock or VirtualClock()
        self.budget = cfg.gpu_memory_budget if cfg.gpu_memory_budget is not None else calibration.device_memory
        self.capacity = arena_capacity(self.budget, cfg.workspace_bytes)
        self.block_tokens = cfg.kv_block_tokens
        # The legacy executor (the computron policy's) waits for a load to end before it returns (the
        # engine stands still, every model's batches with it) and computes after it; ours returns at
        # once and computes layer group i once group i has landed.
        legacy = (cfg.executor or ("legacy" if cfg.policy == "computron" else "inprocess")) == "legacy"
        self.overlap = not legacy
        # The legacy executor's device weights live in PyTorch's allocator, outside the arena, which
        # holds only the KV caches (the scheduler of the computron policy counts models, not bytes).
        self.weights_in_arena = not legacy
        self.legacy = legacy
        # the in-process executor's striped swap-in: a model's load also pulls through these devices' links
        if legacy and cfg.stripe_devices:
            raise ValueError("stripe_devices: the legacy executor (the computron policy's) copies through one link, "
                             "as the original did; striped swap-ins are the in-process executor's")
        self.stripe = tuple(cfg.stripe_devices)
        # under workers the scheduler lends the links load by load (Residency.stripes); in process, every load
        self.lent = (cfg.executor or "inprocess") == "workers"
        self.n_devices = devices
        self.token = token
        self.together = cfg.models_per_step > 1  # batches of several models may share a device's step
        # decode graphs: the batch sizes that have one (none without graphs, with no capture cost, or
        # under the legacy executor, whose weights move at every load and whose decode runs eager)
        capture = calibration.graph_capture_s or calibration.graph_capture_s_per_byte or \
            calibration.graph_warmup_s or calibration.graph_warmup_s_per_byte
        self.graph_sizes = buckets(cfg.max_batch_size) if cfg.cuda_graphs and capture and not legacy else None
        # A run may go on past the ends of some of its sequences (``ExecuteBatch.lasts``) where a step of
        # fewer sequences never takes longer (no graph to capture for a smaller bucket, no negative cost
        # a sequence): the engine's bound for the run (``steps_before`` of the whole batch) still holds.
        self.end_runs = self.graph_sizes is None and \
            min(calibration.decode_seq_s, calibration.decode_seq_s_per_byte, calibration.server_seq_s) >= 0
        self.pinned_free = 0  # legacy: bytes of page-locked host copies freed and cached for reuse (process-wide)
        self.models: dict[str, _Model] = {}
        self.weights = [0] * devices
        self.kv = [0] * devices
        self.link_free = [0.0] * devices  # when each device's copy stream is idle again
        self.seqs: dict[str, _Seq] = {}
        self.host: dict[str, int] = {}  # req_id -> blocks of its cache in host memory (moved out)
        self.host_bytes = 0
        self.unreported: dict[str, _Model] = {}  # models whose last load was not reported as ended yet
        self.stats = {"loads": 0, "evictions": 0, "steps": 0, "load_s": 0.0, "compute_s": 0.0, "graph_captures": 0,
                      "kv_moved_bytes": 0, "kv_move_s": 0.0, "host_peak_bytes": 0, "pinned_bytes": 0, "pin_s": 0.0}

    # ---- models --------------------------------------------------------------------------------
    def register(self, desc: ModelDescription, progress: Callable[[str], None] | None = None) -> ModelInfo:
        if desc.name in self.models:
            raise ValueError(f"a model named {desc.name!r} is already registered")
        if desc.placement.dims.world_size != 1:
            raise ValueError(f"model {desc.name!r}: the simulator models one rank per model today "
                             f"(asked for {desc.placement.dims})")
        (dev,) = desc.placement.devices
        if not 0 <= dev < self.n_devices:
            raise ValueError(f"model {desc.name!r} is placed on device {dev}; the simulator has {self.n_devices}")
        cfg, ckpt = resolve_model(desc.source, dtype=desc.dtype)
        groups = group_bytes(cfg)
        nbytes = sum(groups)
        if nbytes > self.capacity or (desc.max_bytes is not None and nbytes > desc.max_bytes):
            raise ValueError(f"model {desc.name!r} needs {nbytes} bytes of weights, more than the "
                             f"{min(self.capacity, desc.max_bytes or self.capacity)} bytes allowed")
        token = self.token if self.token != cfg.eos_token_id else self.token + 1
        if token >= cfg.vocab_size:
            raise ValueError(f"model {desc.name!r}: token id {token} is outside its vocabulary of {cfg.vocab_size}")
        info = ModelInfo(desc.name, cfg, ckpt, Placement(desc.placement.dims, (dev,)), (nbytes,),
                         (cfg.kv_bytes_per_token(),))
        self.models[desc.name] = _Model(info, groups, kv_region_bytes(self.block_tokens, cfg.kv_bytes_per_token()),
                                        token)
        return info

    def unregister(self, name: str) -> None:
        m = self.models.get(name)
        if m is not None and m.ready is not None:
            self._evict(m)
        self.models.pop(name, None)

    # ---- residency -----------------------------------------------------------------------------
    def apply(self, change: Residency) -> dict[str, float]:
        for rid in change.release:
            self._release(rid)
        for rid in change.kv_out:
            self._kv_out(rid)
        evicted = {}
        for name in change.evict:
            m = self.models[name]
            t0 = self.clock.t
            if m.load_end > t0:  # copies in flight must land before the region is reused
                self.clock.advance_to(m.load_end)
            self.clock.advance(self.cal.evict_s + self.cal.evict_s_per_byte * m.nbytes + self._pin(m))
            self._evict(m)
            evicted[name] = self.clock.t - t0
        for name in change.load:
            m = self.models[name]
            if m.ready is None:
                self._load(m, change.stripes.get(name, ()) if self.lent else self.stripe)
                if not self.overlap:  # the legacy executor waits for its load stream: the engine stands still
                    self.clock.advance_to(m.load_end)
        for rid in change.kv_in:
            self._kv_in(rid)
        return evicted

    def _pin(self, m: _Model) -> float:
        """Legacy: seconds of allocating the page-locked host memory an eviction of ``m`` copies into
        (what the cache of freed copies does not hold); its previous page-locked copy is freed after."""
        if not self.legacy:
            return 0.0
        reuse = min(m.nbytes, self.pinned_free)
        alloc = m.nbytes - reuse
        self.pinned_free -= reuse
        if m.pinned:
            self.pinned_free += m.nbytes
        m.pinned = True
        s = alloc * self.cal.evict_pin_s_per_byte
        self.stats["pinned_bytes"] += alloc
        self.stats["pin_s"] += s
        return s

    def _copy(self, d: int, nbytes: int) -> float:
        """Queue a cache copy of ``nbytes`` on device d's copy stream (behind the loads); when it ends."""
        start = max(self.clock.t, self.link_free[d])
        self.link_free[d] = start + nbytes / self.cal.bandwidth(d)
        self.stats["kv_moved_bytes"] += nbytes
        self.stats["kv_move_s"] += self.link_free[d] - start
        return self.link_free[d]

    def _kv_out(self, rid: str) -> None:
        """A stopped request's blocks go to host memory: the copy takes the link, the device memory is free."""
        seq = self.seqs.get(rid)
        if seq is None or not seq.blocks:
            return
        m, n = seq.model, seq.blocks * seq.model.block_bytes
        self._copy(m.device, n)
        self.kv[m.device] -= n
        self.host[rid] = seq.blocks
        self.host_bytes += n
        self.stats["host_peak_bytes"] = max(self.stats["host_peak_bytes"], self.host_bytes)
        seq.blocks = 0

    def _kv_in(self, rid: str) -> None:
        """Its blocks come back: booked on the device now, its model computes once the copy has landed."""
        blocks = self.host.pop(rid, None)
        if blocks is None:
            return
        seq = self.seqs[rid]
        m, n = seq.model, blocks * seq.model.block_bytes
        self.host_bytes -= n
        d = m.device
        if self._arena_weights(d) + self.kv[d] + n > self.capacity:
            raise MemoryError(f"the cache of {rid!r} ({n} bytes) coming back exceeds the arena of device {d}")
        self.kv[d] += n
        seq.blocks = blocks
        m.kv_ready = max(m.kv_ready, self._copy(d, n))

    def _load(self, m: _Model, helpers: tuple[int, ...] = ()) -> None:
        d = m.device
        if self.weights_in_arena and self.weights[d] + self.kv[d] + m.nbytes > self.capacity:
            raise MemoryError(f"loading {m.info.name!r} ({m.nbytes} bytes) exceeds the arena of device {d}: "
                              f"{self.weights[d]} bytes of weights and {self.kv[d]} of KV cache in use of "
                              f"{self.capacity}")
        self.weights[d] += m.nbytes
        start = max(self.clock.t, self.link_free[d])
        bw = self.cal.striped_bandwidth((d, *helpers)) if helpers else self.cal.bandwidth(d)
        if self.legacy and not m.pinned and self.cal.pageable_swap_bandwidth:
            bw = self.cal.pageable_swap_bandwidth  # never evicted: its host copy is still pageable
        ready, done = [], 0
        for g in m.groups:
            done += g
            ready.append(start + done / bw)
        m.ready, m.load_start, m.load_end, m.reported = ready, start, ready[-1], False
        m.captured.clear()  # back at another address, most likely: its graphs are captured again
        self.unreported[m.info.name] = m
        self.link_free[d] = m.load_end
        self.stats["loads"] += 1
        self.stats["load_s"] += m.load_end - start

    def _arena_weights(self, d: int) -> int:
        """Bytes of weights in device d's arena (none for the legacy executor: its weights are outside)."""
        return self.weights[d] if self.weights_in_arena else 0

    def _evict(self, m: _Model) -> None:
        self.weights[m.device] -= m.nbytes
        m.ready, m.reported = None, True
        self.unreported.pop(m.info.name, None)
        self.stats["evictions"] += 1

    # ---- requests ------------------------------------------------------------------------------
    def free(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self._release(rid)
            self.seqs.pop(rid, None)

    def _release(self, rid: str) -> None:
        blocks = self.host.pop(rid, None)
        if blocks is not None:
            self.host_bytes -= blocks * self.seqs[rid].model.block_bytes
        seq = self.seqs.get(rid)
        if seq is not None and seq.blocks:
            m = seq.model
            self.kv[m.device] -= seq.blocks * m.block_bytes
            seq.blocks = 0

    def execute(self, batches: list[ExecuteBatch]) -> _Done:
        try:
            return _Done(self._execute(batches))
        except Exception as e:  # as the real executors: the step's error travels in the future
            return _Done(error=e)

    def _execute(self, batches: list[ExecuteBatch]) -> StepResult:
        now = self.clock.t
        result = StepResult()
        tokens, end, bt, cap = result.tokens, now, self.block_tokens, self.capacity
        seqs, kv, steps = self.seqs, self.kv, 0
        shared: dict[int, list] | None = {} if self.together else None  # device -> [(model, s, weight bytes, compute s)]
        for batch in batches:
            m = self.models[batch.model]
            if m.ready is None:
                raise RuntimeError(f"model {batch.model!r} runs a batch but is not on its device")
            d, bb, k, lasts = m.device, m.block_bytes, batch.steps, batch.lasts
            if lasts:
                self._check_lasts(m, batch, now)
            room = cap - self._arena_weights(d)  # for its KV blocks (no weights move during a step)
            if k > steps:
                steps = k
            tok: int | list[int] = [m.token] * k if k > 1 else m.token
            prefill = decode = prompts = 0
            ended = 0  # blocks of the sequences that end before the run's last step
            for s in batch.seqs:
                rid, past = s.req_id, s.past
                ks = k if lasts is None else lasts.get(rid, k)  # the steps it runs
                n = len(s.tokens) + ks - 1  # a run of k steps writes k positions
                seq = seqs.get(rid)
                if past:
                    decode += 1
                else:
                    prefill += len(s.tokens)  # its prompt (a run's later steps decode it)
                    prompts += 1
                    if self.host and rid in self.host:  # a recompute drops a cache in host memory too
                        self._release(rid)
                    if seq is not None and seq.blocks:  # a recompute starts from an empty cache
                        kv[d] -= seq.blocks * bb
                        seq.blocks = 0
                if seq is None:
                    seq = seqs[rid] = _Seq(m)
                need = (past + n + bt - 1) // bt
                if need > seq.blocks:
                    kv[d] += (need - seq.blocks) * bb
                    seq.blocks = need
                    if kv[d] > room and lasts is None:
                        raise MemoryError(f"KV cache of {rid!r} exceeds the arena of device {d}: "
                                          f"{self._arena_weights(d)} + {kv[d]} > {cap} bytes")
                if ks == k:
                    tokens[rid] = tok
                else:
                    tokens[rid] = [m.token] * ks if ks > 1 else m.token
                    ended += seq.blocks * bb
            if lasts is not None and kv[d] - ended > room:  # the blocks of those that end are free by its end
                raise MemoryError(f"KV cache of {batch.model!r}'s run exceeds the arena of device {d}: "
                                  f"{self._arena_weights(d)} + {kv[d] - ended} > {cap} bytes")
            compute = batch_time(self.cal, m.nbytes, prefill, decode, prompts) if prefill else \
                self._decode_time(m, decode)
            capture = self._capture(m, decode) if not prefill and self.graph_sizes else 0.0
            run = bool(prefill) and k > 1  # its first step prefills, the k - 1 after it decode the whole batch
            if m.load_end > now:  # cold: group i computes once group i has landed (legacy: once all have)
                finish = pipelined_finish(now, compute, m.groups, m.ready) if self.overlap else m.load_end + compute
            elif run:
                finish = now + compute
            elif lasts:  # the batch shrinks where some of its sequences end: a stretch of equal steps each
                finish = self._stretches(m, batch, decode, result, now)
                compute = finish - now
            else:
                compute *= k  # a run is warm: k equal steps
                finish = now + compute
            if m.kv_ready > now:  # caches moved back must land before its step computes
                finish = max(finish, m.kv_ready + compute)
            if run:  # the new requests' first tokens come at the first step's end
                if result.first_at is None:
                    result.first_at = {}
                result.first_at[batch.model] = finish
                rest = self._decode_time(m, len(batch.seqs)) * (k - 1)
                capture = self._capture(m, len(batch.seqs)) if self.graph_sizes else 0.0
                finish += rest
                compute += rest
            finish += capture
            result.compute_s[batch.model] = finish - now
            if shared is not None:
                shared.setdefault(d, []).append((batch.model, finish - now, m.nbytes, compute + capture))
            if not lasts:
                self.stats["compute_s"] += compute + capture
            if not m.reported:
                result.loaded[batch.model] = m.load_end - m.load_start
                m.reported = True
                del self.unreported[batch.model]
            if finish > end:
                end = finish
        if shared:
            for runs in shared.values():
                if len(runs) > 1:  # at once on one device: every batch ends with the last
                    t = self.cal.together([r[1] for r in runs], sum(r[2] for r in runs))
                    busy = [r[3] for r in runs]  # the device's own compute: what each batch booked, shared
                    self.stats["compute_s"] += self.cal.together(busy, sum(r[2] for r in runs)) - sum(busy)
                    for name, _, _, _ in runs:
                        result.compute_s[name] = t
                    if now + t > end:
                        end = now + t
        self.stats["steps"] += steps
        self.clock.advance_to(end)
        if self.unreported:
            self._poll_loads(result.loaded)
        return result

    def _check_lasts(self, m: _Model, batch: ExecuteBatch, now: float) -> None:
        """Refuse a run whose sequences end early (``ExecuteBatch.lasts``) unless this executor runs
        such runs (``end_runs``), it decodes a warm batch, and each of those sequences is in it and runs
        1 to ``steps`` of its steps."""
        lasts, k = batch.lasts, batch.steps
        assert lasts is not None
        why = None
        if not self.end_runs:
            why = "this executor does not run them (end_runs: its calibration captures decode graphs)"
        elif m.load_end > now or m.kv_ready > now or any(not s.past for s in batch.seqs):
            why = "they must decode a warm batch"
        else:
            rids = {s.req_id for s in batch.seqs}
            bad = [(r, n) for r, n in lasts.items() if r not in rids or not 0 < n <= k]
            if bad:
                why = f"each must be a sequence of the batch that runs 1 to {k} steps, got {bad[:3]}"
        if why is not None:
            raise ValueError(f"a run of {batch.model!r} whose sequences end early: {why}")

    def _stretches(self, m: _Model, batch: ExecuteBatch, decode: int, result: StepResult, now: float) -> float:
        """When a warm decode run whose sequences of ``batch.lasts`` end early ends: a stretch of equal
        steps up to each end, timed as a run of that many steps of the sequences left would be, one
        after the other (the same sums, in the same order); each ending sequence's ``ended_at`` is
        its stretch's end. Books the compute of each stretch (no decode graphs: ``end_runs``)."""
        lasts = batch.lasts
        assert lasts is not None
        at: dict[int, list[str]] = {}
        for rid, ks in lasts.items():
            at.setdefault(ks, []).append(rid)
        ended_at = result.ended_at
        if ended_at is None:
            ended_at = result.ended_at = {}
        t, done, left = now, 0, decode
        for ks in sorted(at) + [batch.steps]:
            if ks <= done:
                continue
            compute = self._decode_time(m, left) * (ks - done)
            t = t + compute
            self.stats["compute_s"] += compute
            for rid in at.get(ks, ()):
                ended_at[rid] = t
                left -= 1
            done = ks
        return t

    def _decode_time(self, m: _Model, batch: int) -> float:
        """``batch_time`` of a decode step of ``batch`` sequences of ``m``, computed once per batch size
        (the same float: a pure function of the calibration, the model's bytes and the batch)."""
        dt = m.decode_s.get(batch)
        if dt is None:
            dt = m.decode_s[batch] = batch_time(self.cal, m.nbytes, 0, batch)
        return dt

    def _capture(self, m: _Model, batch: int) -> float:
        """Seconds of capturing the decode graph of ``batch`` sequences' bucket, the first time it runs
        since ``m`` was loaded (eager past the largest bucket: nothing to capture)."""
        sizes = self.graph_sizes
        assert sizes is not None  # called only with decode graphs
        bucket = bucket_of(batch, sizes)
        if bucket is None or bucket in m.captured:
            return 0.0
        m.captured.add(bucket)
        first = bucket not in m.warmed
        m.warmed.add(bucket)
        self.stats["graph_captures"] += 1
        return self.cal.capture_time(m.nbytes, first)

    def after_stretches(self, model: str, stretches: list[tuple[int, int]]) -> float:
        """The clock after these stretches of (steps, batch size) of a warm decode run of ``model`` from
        now, as ``_stretches`` adds them up (without graphs: see ``end_runs``)."""
        m, t = self.models[model], self.clock.t
        for k, n in stretches:
            t = t + self._decode_time(m, n) * k
        return t

    def steps_before(self, model: str, batch: int, until: float, cap: int,
                     prefill: tuple[int, int] | None = None, after: list[tuple[int, int]] | None = None) -> int:
        """How many steps of ``batch`` sequences of a warm ``model``, one after another from now, run
        before one ends at or after ``until`` (that one included), at most ``cap``: the run that single
        steps would make before a request arriving at ``until`` is seen. Decode steps; with ``prefill``
        (tokens, prompts), the first step also computes those prompts. ``after``: from the end of these
        stretches of (steps, batch size) of a warm run instead of now, timed as ``_stretches`` times them."""
        m = self.models[model]
        now = self.after_stretches(model, after) if after else self.clock.t
        if cap <= 1 or m.ready is None or m.load_end > now:
            return 1
        if until == math.inf:
            return cap
        dt = self._decode_time(m, batch)
        first = 0.0  # the run's first decode step captures its bucket's graph, if it was not yet
        if self.graph_sizes:
            bucket = bucket_of(batch, self.graph_sizes)
            if bucket is not None and bucket not in m.captured:
                first = self.cal.capture_time(m.nbytes, bucket not in m.warmed)
        if prefill is None:
            return min(cap, max(math.ceil((until - now - first) / dt), 1))
        tokens, prompts = prefill
        p = batch_time(self.cal, m.nbytes, tokens, batch - prompts, prompts)
        if now + p >= until:
            return 1
        return min(cap, max(1 + math.ceil((until - now - p - first) / dt), 2))

    def _poll_loads(self, out: dict[str, float], wait: bool = False) -> None:
        t = self.clock.t
        for name, m in list(self.unreported.items()):
            if wait or m.load_end <= t:
                out[name] = m.load_end - m.load_start
                m.reported = True
                del self.unreported[name]

    def wait_loads(self) -> dict[str, float]:
        ends = [m.load_end for m in self.unreported.values()]
        if ends:
            self.clock.advance_to(max(ends))
        out: dict[str, float] = {}
        self._poll_loads(out, wait=True)
        return out

    # ---- status --------------------------------------------------------------------------------
    def resize(self, device: int, nbytes: int) -> int:
        """Accounting only: the simulated arena keeps its size (budgets are the scheduler's)."""
        return min(max(nbytes, self._arena_weights(device) + self.kv[device]), self.capacity)

    def status(self) -> ExecutorStatus:
        t = self.clock.t
        devs = [DeviceStatus(d, f"sim:{d}", self.capacity, self.weights[d], self.kv[d], 0, self.budget)
                for d in range(self.n_devices)]
        models = {n: ("loading" if m.load_end > t else "resident") for n, m in self.models.items()
                  if m.ready is not None}
        return ExecutorStatus(devs, models, self.block_tokens, dict(self.stats), prefill_runs=True,
                              end_runs=self.end_runs)

    def probe_link(self, name: str, repeats: int) -> list[float]:
        m = self.models[name]
        return [self.cal.load_time(m.nbytes, m.device, self.legacy and not m.pinned)] * repeats

    def shutdown(self) -> None:
        for m in self.models.values():
            if m.ready is not None:
                self._evict(m)
