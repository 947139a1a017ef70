"""Scheduler: per-model FIFO queues, iteration-level batching, and the one memory model.

Input: models (bytes per rank, and the device of each rank), requests, the time, and after each
step which requests ran. Output: a ``StepPlan`` per step. It never touches a tensor: the engine
core hands the plan to an executor, whose arena only checks what the scheduler decided.

Memory (``memory.py``, a mixin: budgets, victims, switching) is accounted in bytes per device against that device's budget: weights of every model
on the device (resident or loading) plus the KV cache reserved by running requests. Counters
are kept incrementally, and models with work sit in a heap keyed by their oldest request, so a
step costs about the same with 8 models or 512 and with 10 queued requests or 10,000.

Striped swap-in (``stripe_devices``, the worker executor's): a load of a model on one device borrows
the host links of the stripe devices that have no load in flight (none loading there, none lent to
another load) and room for the staging they lend; the plan names them (``plan.stripes``) and the
staging is booked on each helper's budget until the executor reports the load done.

Policies:
- ``default``: models run in the order of their oldest outstanding request; one batch per model
  per step, batches of one step on disjoint devices (up to ``models_per_step`` batches of
  different models a device). A model not on its devices is loaded,
  evicting models with nothing running, least recently used first. The next model with work is
  prefetched while others compute, when it fits without evicting a model that has work.
  No request waits forever: once a request cannot start because memory is held by running
  requests of other models, those models stop admitting requests newer than it, drain, and
  yield their memory.
- ``preempt``: the default, except that once such a request has waited ``max_wait_s`` (counted from
  its model's last stop, if that is later: the model that took over runs that long before it is
  stopped in turn) the models whose running requests are in its way are stopped instead of drained: their weights are evicted
  and their requests paused, their KV blocks kept on the devices, to resume as decodes when the
  model is back. Blocks of paused requests are given up (those requests recompute their cache
  later, cheapest first) only when their memory is needed and evicting idle models does not do.
  With ``preempt_keeps_kv`` off, stopped requests always recompute.
- ``slo``: deadline-driven (``slo.py``). Each model has a cost (load, prefill, decode step) and an
  SLO (time to first token and per output token, by default ``slo_scale`` times its solo figures,
  or one latency for all its requests); each request has a deadline. The preempt policy's loop with
  models in order of their earliest deadline instead of their oldest request: each step runs the
  model whose request is due first, so models interleave at decode-step granularity as deadlines
  demand. A model that cannot start for memory held by running models stops them (between decode
  steps) once its slack runs out, or its head has waited ``max_wait_s``: only those whose slack,
  less a reload and a recompute, exceeds its own, most slack first. Each stopped request keeps its
  KV blocks where the memory is spare after the switch (room for the incoming model and one more
  model's weights), else recomputes. Admission: every full step lays the models' work out in
  deadline order; wherever it ends past a deadline, the waiting request that needs the most time is
  refused with the reason (``plan.failed``; Moore and Hodgson's rule, which keeps the most requests
  on time). A head request that has waited ``max_wait_s`` without starting goes first (its model's
  key is -inf).
- ``computron``: the original Computron, for comparison: at most ``max_loaded`` models per
  device (a count, not bytes; the weights live outside the budget), first come first served
  across models, no prefetch.
"""

from __future__ import annotations

import math
from heapq import heapify, heappop, heappush, heapreplace
from dataclasses import dataclass
from typing import Callable, cast

from ..memory.units import kv_region_bytes
from .memory import Memory
from .slo import Deadlines, ModelCost, Slo
from .state import LOADING, RESIDENT, Batch, ModelState, SchedRequest, StepPlan

POLICIES = ("default", "preempt", "slo", "computron")
# a driver's bound on a run of steps, asked once the batch is known: (model, batch size, (tokens, prompts)
# its first step prefills, or None; the stretches of the same run before this one, as (steps, batch size),
# where it goes on past some of its requests' ends) -> steps from there
Bound = Callable[[str, int, "tuple[int, int] | None", "list[tuple[int, int]]"], int]


@dataclass
class SchedulerConfig:
    budgets: tuple[int, ...] | int  # bytes for weights + KV cache, per device (an int: one device)
    policy: str = "default"
    max_batch_size: int = 32
    max_tokens_per_step: int = 2048
    max_loaded: int = 1  # computron policy only: models per device
    prefetch: bool = True
    models_per_step: int = 1  # batches of different models one step may run on a device (see EngineConfig)
    load_bandwidth: float | None = None  # bytes/s per device, to estimate when a load ends
    block_tokens: int = 16  # tokens per block of the paged KV cache
    max_wait_s: float = 1.0  # preempt policy: a request kept from starting this long preempts what blocks it
    preempt_keeps_kv: bool = False  # preempt policy: stopped requests keep their KV blocks while they fit
    slo_scale: float = 5.0  # slo policy: a model's SLO, when none is given, is this times its solo figures
    # policies that keep stopped requests' caches (preempt with preempt_keeps_kv, slo): host bytes those
    # caches may take when their device memory is needed (0: none; they recompute instead)
    kv_host_bytes: int = 0
    # Striped swap-in (the worker executor's): devices whose host links a load of a one-device model
    # may borrow while they have no load in flight, and the staging bytes each lends meanwhile.
    stripe_devices: tuple[int, ...] = ()
    stripe_staging: int = 0
    # the executor runs a batch of several steps whose first prefills (``ExecutorStatus.prefill_runs``)
    prefill_runs: bool = False
    # the executor runs a batch of several steps some of whose requests end before its last step
    # (``ExecutorStatus.end_runs``, ``StepPlan.ends``)
    end_runs: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.budgets, int):
            self.budgets = (self.budgets,)
        self.budgets = tuple(self.budgets)
        self.stripe_devices = tuple(self.stripe_devices)
        bad = [d for d in self.stripe_devices if not 0 <= d < len(self.budgets)]
        if bad:
            raise ValueError(f"stripe_devices {bad}: a helper must be one of the {len(self.budgets)} devices "
                             f"(0 to {len(self.budgets) - 1})")
        if self.stripe_devices and self.stripe_staging < 1:
            raise ValueError(f"stripe_staging must be at least 1 byte with stripe_devices, got {self.stripe_staging}")
        if self.models_per_step < 1:
            raise ValueError(f"models_per_step must be at least 1, got {self.models_per_step}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if not self.budgets:
            raise ValueError("budgets needs at least one device")
        if self.kv_host_bytes < 0:
            raise ValueError(f"kv_host_bytes must be >= 0, got {self.kv_host_bytes}")
        for name in ("max_batch_size", "max_tokens_per_step", "max_loaded", "block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for d, b in enumerate(self.budgets):
            if b < 1:
                raise ValueError(f"the budget of device {d} must be at least 1 byte, got {b}")


class Scheduler(Memory):
    def __init__(self, config: SchedulerConfig):
        self.config = config
        budgets = config.budgets
        assert isinstance(budgets, tuple)  # SchedulerConfig made it one
        self.budgets = budgets  # config.budgets, as the tuple it is
        self.counts_bytes = config.policy != "computron"  # computron: weights live outside the budget
        self.preempts = config.policy in ("preempt", "slo")
        self.keeps_kv = config.policy == "preempt" and config.preempt_keeps_kv or config.policy == "slo"
        self.slo = Deadlines(config.max_wait_s, config.models_per_step) if config.policy == "slo" else None
        if self.slo is not None and config.stripe_devices:  # loads get the links idle when they start
            self.slo.links = lambda m: len(self._idle_links(m))
        # host memory for the KV blocks of stopped requests (state ``offloaded``): its bytes, and counters
        self.kv_host = config.kv_host_bytes if self.keeps_kv else 0
        self.host_used = 0
        self.kv_offloaded = self.kv_restored = self.kv_moved_bytes = 0
        # preempt policy: a model whose running requests were stopped for another's (name ->
        # that other) admits nothing until the other is on its devices; and when the oldest
        # blocked request's wait runs out (a full search is due then, even in a steady run)
        self._yielded: dict[str, str] = {}
        self.deadline: float | None = None
        self.switches = 0
        n = len(budgets)
        self.weights_used = [0] * n
        self.kv_used = [0] * n
        self.staging_used = [0] * n  # striped swap-ins: staging booked on helpers while their links are lent
        self.lent: dict[int, str] = {}  # helper device -> the model whose load borrows its link now
        self.on_device: list[dict[str, ModelState]] = [{} for _ in range(n)]
        self.models: dict[str, ModelState] = {}
        self.requests: dict[str, SchedRequest] = {}
        self.step_count = 0
        self._heap: list[tuple[float, int, ModelState]] = []  # (oldest arrival, tie, model) of models with work; stale entries skipped
        self._ties = 0  # the next tie: orders entries of equal keys in the heaps by when they were made
        self._fresh: set[str] = set()  # models this plan loads: never evicted by the same plan
        # Bumped whenever memory or what may be evicted changes; a model found unable to start
        # (or to be prefetched) stays so until then, so steady steps do not search again.
        self._epoch = 0
        self._changes = 0  # bumped by arrivals and model changes; with _epoch it says "nothing changed"
        self._steady: tuple[tuple[int, int], ModelState] | None = None  # ((epoch, changes), model) after a step that only decoded it
        # Requests of the steady model ended since (``finish``): its batch goes on only if ``_keeps`` says
        # nothing could use the memory they freed. ``_held``: what held back admission where the last
        # full search made its batch (``hold_after`` then; the steady model's head waits while newer).
        self._recheck = False
        self._held: float | None = None
        self._keeps_plans = config.policy == "default" and config.models_per_step == 1  # ``_keeps`` may say yes
        self._ends: dict[str, int] | None = None  # the last run's ``StepPlan.ends``
        self._at_once = True  # long stretches' blocks granted in one pass (``_grant_all``; off: one at a time)
        self.at_once = [0, 0]  # stretches whose blocks were granted in one pass, and those that did not all fit
        self._cut = False  # this plan's admission stopped at the token budget (the next step admits more)
        self.shares = list(self.budgets)  # what inference may use now (colocation: see set_budget)
        self.free = list(self.shares)  # per device: the share less what is booked (kept as it changes)

    # ---- models --------------------------------------------------------------------------------
    def add_model(self, name: str, weights: tuple[int, ...] | int, kv_per_token: tuple[int, ...] | int,
                  devices: tuple[int, ...] = (0,), pinned: bool = False, cost: ModelCost | None = None,
                  slo: Slo | None = None) -> None:
        """Register a model: bytes per rank, the device of each rank. The slo policy needs its
        ``cost``; its ``slo`` defaults to ``slo_scale`` times the solo figures of that cost."""
        weights = (weights,) if isinstance(weights, int) else tuple(weights)
        kv_per_token = (kv_per_token,) if isinstance(kv_per_token, int) else tuple(kv_per_token)
        devices = tuple(devices)
        if name in self.models:
            raise ValueError(f"model {name!r} is already registered")
        if not len(weights) == len(kv_per_token) == len(devices):
            raise ValueError(f"model {name!r}: {len(devices)} devices but {len(weights)} weight sizes and "
                             f"{len(kv_per_token)} KV sizes")
        for d, w in zip(devices, weights):
            if not 0 <= d < len(self.budgets):
                raise ValueError(f"model {name!r} is placed on device {d}, but there are "
                                 f"{len(self.budgets)} devices")
            if self.counts_bytes and w > self.budgets[d]:
                raise ValueError(f"model {name!r} needs {w} bytes of weights on device {d}, more than its "
                                 f"whole budget of {self.budgets[d]} bytes")
        if self.slo is not None:
            if cost is None:
                raise ValueError(f"model {name!r}: the slo policy needs its cost (load, prefill and decode seconds)")
            self.slo.costs[name] = cost
            self.slo.slos[name] = slo or Slo.solo(cost, self.config.slo_scale)
        blocks = tuple(kv_region_bytes(self.config.block_tokens, k) for k in kv_per_token)
        self.models[name] = ModelState(name, devices, weights, blocks, pinned)
        self._changes += 1

    def remove_model(self, name: str) -> None:
        m = self._model(name)
        if m.has_work:
            raise ValueError(f"model {name!r} still has {len(m.waiting) + len(m.running) + len(m.paused)} requests")
        if m.on_device:
            self._set_offloaded(m)
        del self.models[name]
        if self.slo is not None:
            del self.slo.costs[name], self.slo.slos[name]
        self._changes += 1

    def set_pinned(self, name: str, pinned: bool) -> None:
        self._model(name).pinned = pinned
        self._epoch += 1

    def state(self, name: str) -> str:
        return self._model(name).state

    def model_stats(self, name: str) -> dict:
        m = self._model(name)
        return {"state": m.state, "waiting": len(m.waiting), "running": len(m.running), "paused": len(m.paused),
                "kv_offloaded": sum(r.state == "offloaded" for r in m.paused.values()),
                "pinned": m.pinned,
                "devices": list(m.devices)}

    def _model(self, name: str) -> ModelState:
        try:
            return self.models[name]
        except KeyError:
            raise KeyError(f"unknown model {name!r}; registered: {', '.join(self.models) or 'none'}") from None

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, req: SchedRequest) -> None:
        m = self._model(req.model)
        if req.id in self.requests:
            raise ValueError(f"request id {req.id!r} is already in use")
        full = self._blocks(req.prompt_len + req.max_tokens)  # it must be able to finish alone
        for d, w, bb in zip(m.devices, m.weights, m.block_bytes):
            kv = full * bb
            need = kv + (w if self.counts_bytes else 0)
            if need > self.budgets[d]:
                raise ValueError(f"request {req.id!r} needs {kv} bytes of KV cache on device {d}; with the "
                                 f"model's {w} bytes that exceeds the budget of {self.budgets[d]} bytes")
        self.requests[req.id] = req
        if self.slo is not None:
            req.alone_s = self.slo.alone(m, req)
        if not self.joins_queue(req.model, req.arrival):
            self._changes += 1
        m.waiting.append(req)
        self._queue(m)

    def joins_queue(self, model: str, arrival: float) -> bool:
        """Would a request of ``model`` arriving at ``arrival`` only wait behind others of its model?
        Then it changes no plan: a queue is looked at from its head, and a head that cannot start
        keeps those behind it from starting; a steady batch goes on. If it does, so does any later
        arrival of ``model`` (the simulator relies on that to look ahead cheaply)."""
        m = self.models.get(model)
        look = Deadlines.LOOK if self.slo is not None else 1  # slo: the first few waiting set its slack
        return m is not None and len(m.waiting) >= look and m.waiting[-1].arrival <= arrival

    def finish(self, req_id: str) -> None:
        """A request ended (completed, failed or cancelled): drop it and free its KV reservation."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return
        m = self.models[req.model]
        steady = self._steady
        mine = steady is not None and steady[1] is m and req.state == "running" and \
            steady[0] == (self._epoch, self._changes)  # a running request of the steady batch, nothing else since
        self._epoch += 1
        if req.state in ("running", "paused", "offloaded"):
            del (m.running if req.state == "running" else m.paused)[req_id]
            self._drop_blocks(m, req)
        else:
            m.waiting.remove(req)
        req.state = "finished"
        self._queue(m)
        if mine and m.running:  # its batch may go on: ``_keeps`` decides at the next step
            self._steady, self._recheck = ((self._epoch, self._changes), m), True

    def update(self, plan: StepPlan, steps: int = 1) -> None:
        """The plan's batches ran ``steps`` times (several decode steps advanced in one call).
        Costs one addition per batch: a request's progress is its model's steps since it joined."""
        models = self.models
        for b in plan.batches:
            m = models.get(b.model)
            if m is not None:
                m.steps += steps

    def generated(self, req_id: str) -> int:
        """Tokens a request has made so far."""
        r = self.requests[req_id]
        return self.models[r.model].steps - r.joined if r.state in ("running", "paused", "offloaded") else r.done

    # ---- residency -----------------------------------------------------------------------------
    def loaded(self, name: str) -> None:
        """The executor reports a model's copies done."""
        m = self.models.get(name)
        if m is not None and m.state == LOADING:
            m.state, m.ready_at = RESIDENT, None
            if m.helpers:
                self._return_links(m)

    def offloaded(self, name: str) -> None:
        """The model is not on its devices (admin offload, or a load that failed)."""
        m = self._model(name)
        if m.running:
            raise ValueError(f"model {name!r} has requests in flight; it cannot be offloaded now")
        if m.on_device:
            self._set_offloaded(m)

    def requeue(self, name: str) -> list[str]:
        """The model's weights and KV caches are gone from its devices (its workers were restarted),
        its requests are not: every running or paused one waits again at the head of its queue, in
        arrival order, and recomputes its cache (prompt and tokens made) when it runs again; the model
        is offloaded. Returns the requeued requests' ids."""
        m = self._model(name)
        plan = StepPlan()
        stopped = sorted([*m.running.values(), *m.paused.values()], key=lambda r: r.arrival, reverse=True)
        for req in stopped:  # the oldest ends first
            self._preempt(m, req, plan)
        if m.on_device:
            self._set_offloaded(m)
        self._epoch += 1
        self._queue(m)
        return plan.preempted

    def plan_load(self, name: str, now: float = 0.0) -> StepPlan:
        """A plan that puts ``name`` on its devices now (admin load), evicting idle models if needed."""
        m = self._model(name)
        plan = StepPlan()
        self._fresh.clear()
        if not self._make_resident(m, set(), plan, plan.loads, now, evict_waiting=False):
            raise ValueError(f"model {name!r} does not fit next to the models that are busy or pinned")
        return plan

    def resident_models(self) -> list[str]:
        return [n for n, m in self.models.items() if m.on_device]

    # ---- the step ------------------------------------------------------------------------------
    def _tie(self) -> int:
        t = self._ties
        self._ties = t + 1
        return t

    def _queue(self, m: ModelState) -> None:
        key = m.oldest() if self.slo is None else self.slo.earliest(m)
        if key != m.heap_key:
            m.heap_key = key
            if key is not None:
                heappush(self._heap, (key, self._tie(), m))

    def _pop_oldest(self) -> tuple[float, ModelState] | None:
        """The model with work whose oldest request is oldest, off the heap (stale entries skipped);
        the caller queues it again with ``_queue``. None when no model has work."""
        heap = self._heap
        while heap:
            key, _, m = heappop(heap)
            if m.heap_key == key and self.models.get(m.name) is m:
                m.heap_key = None  # any other entry of m is stale from now on
                return key, m
        return None

    def _by_age(self, seen: list[tuple[float, ModelState]], i: int) -> tuple[float, ModelState] | None:
        """The ``i``-th model by age in this step: from ``seen``, else the next off the heap (recorded
        in ``seen``); None when there are no more."""
        if i < len(seen):
            return seen[i]
        item = self._pop_oldest()
        if item is not None:
            seen.append(item)
        return item

    def schedule(self, now: float = 0.0, max_steps: int | Bound = 1) -> StepPlan:
        """The next step's plan. ``max_steps`` > 1 lets a plan that only decodes one model's batch
        run up to that many steps back to back (``plan.steps``): it stops after the step where any of
        its requests ends by length (where the executor can, ``end_runs``, it may go on without them if
        the full search would plan the rest again: ``plan.ends``, see ``_run_length``) and before a
        block its tokens need does not fit, so the run decides
        exactly what as many single steps would, provided no request arrives (other than behind
        others, ``joins_queue``) or ends otherwise in between. Where the executor can
        (``prefill_runs``), a plan of one model that also admits requests may start such a run (its
        first step prefills them). A function of (model, batch size, the first step's prefill
        tokens and prompts or None) may give the bound once the batch is known (a driver with a
        cost model: steps that end before the next arrival). With single steps (``max_steps`` 1), a
        steady batch none of whose requests makes its last token in this step is marked
        ``plan.repeats``, as is a step of several models' steady decode batches (``models_per_step``)
        none of whose requests does."""
        self.step_count += 1
        steady = self._steady
        if steady is not None and steady[0] == (self._epoch, self._changes) and \
                (self.deadline is None or now < self.deadline) and (not self._recheck or self._keeps(steady[1])):
            self._recheck = False  # (a run through ends may set it again)
            plan = self._steady_step(steady[1], max_steps)
            if plan is not None:
                return plan
        plan = self._schedule(now)
        b = plan.batches
        quiet = bool(b) and not (plan.loads or plan.prefetch or plan.evictions or plan.preempted or plan.failed
                                 or plan.kv_out)
        prefill = quiet and any(x.prefill for x in b)
        self._steady, self._recheck = None, False
        # One model's batch: the next steps decode it (``_steady``), and a run of them may start now.
        # After requests were just admitted, only while what stopped admission holds (memory, the
        # batch's size, an older request elsewhere; not the token budget) and not under a preempting
        # policy, whose deadlines change with the requests admitted; a run then starts with this step
        # only where the executor runs such runs (``prefill_runs``).
        if quiet and len(b) == 1 and not (prefill and (self._cut or self.preempts)):
            m = self.models[b[0].model]
            self._steady = ((self._epoch, self._changes), m)
            if not prefill:
                plan.steps = self._run(m, max_steps)
                plan.ends = self._ends
                plan.repeats = max_steps == 1 and self._lasts(m, 1)
            elif self.config.prefill_runs:
                plan.steps = self._run(m, max_steps, self._prefill_of(m, b[0]))
        elif quiet and not prefill:  # several models' decode batches (models_per_step): each repeats if
            # none of its requests ends
            plan.repeats = max_steps == 1 and all(self._lasts(self.models[x.model], 1) for x in b)
        return plan

    def _keeps(self, m: ModelState) -> bool:
        """Requests of ``m``, the last plan's only batch, ended since (and nothing else changed): would
        the full search plan its batch again? Yes, under the default policy with one batch a device,
        when nothing it looks at could use the memory they freed on ``m``'s devices, as it then meets
        what it met the last time. ``m`` (it still runs requests) admits nothing: its head waits for an
        older request of another model. Every other model with work on ``m``'s devices is either on
        them, runs requests and is newer than ``m`` (``m``'s batch takes their devices first), or it
        is not on them and its weights do not fit there even evicting every model with nothing running,
        where the search looks at it: one older than ``m`` or the first not on its devices (it loads
        them, or prefetches), or the oldest with nothing running (whose start, weights and head's
        blocks, decides that wait); they could not then either, with less memory free. The others
        it does not look at, and models elsewhere find their devices as they were (should ``m``'s
        oldest request have ended, those it falls behind by age are looked at before it, to the same
        effect: its batch was not what kept them from anything)."""
        if not self._keeps_plans:
            return False
        if m.waiting and (self._held is None or m.waiting[0].arrival <= self._held):
            return False
        key, mine = m.heap_key, m.devices
        assert key is not None  # it runs requests
        inf = math.inf
        first_idle = first_off = inf  # keys of the oldest with nothing running, and of the oldest not on its devices
        for c in self.models.values():
            k = c.heap_key
            if c is m or k is None:  # no work
                continue
            if not c.running and k < first_idle:
                first_idle = k
            if not c.on_device and k < first_off:
                first_off = k
        if not (self.config.prefetch and self.counts_bytes):
            first_off = -inf
        free, on_device = self.free, self.on_device
        for c in self.models.values():
            k = c.heap_key
            if c is m or k is None:
                continue
            devices = c.devices
            for d in devices:
                if d in mine:
                    break
            else:
                continue  # no device of ``m``'s
            if c.on_device:
                if k <= key or (not c.running and k <= first_idle):
                    return False  # it may come first by age, or start
                continue
            if k > key and k > first_off and k > first_idle:
                continue  # the search does not look at it
            weights = c.weights
            for i, d in enumerate(devices):
                n = weights[i]
                for x in on_device[d].values():
                    if not x.running and not x.pinned:
                        n -= x.weights[x.devices.index(d)]
                if n > free[d]:
                    break  # it does not fit on ``d``
            else:
                return False
        return True

    def _prefill_of(self, m: ModelState, batch: Batch) -> tuple[int, int]:
        """(tokens, prompts) the prefills of ``batch`` compute in its first step: each prompt and the
        tokens a preempted request made before (admission set its ``joined`` back by them and cleared
        its ``done``)."""
        reqs = self.requests
        return sum(reqs[r].prompt_len + m.steps - reqs[r].joined for r in batch.prefill), len(batch.prefill)

    def _run(self, m: ModelState, max_steps: int | Bound,
             prefill: tuple[int, int] | None = None) -> int:
        """Steps the batch of ``m`` runs from this one on (see ``_run_length``): decode steps, after a
        first step that also computes ``prefill`` (tokens, prompts) when requests were just admitted."""
        self._ends = None
        bound = None
        if not isinstance(max_steps, int):
            bound = max_steps
            max_steps = bound(m.name, len(m.running), prefill, [])
        if max_steps <= 1:
            return 1
        steps = self._run_length(m, max_steps, prefill is None and self._keeps_plans and self.config.end_runs, bound)
        self.step_count += steps - 1
        m.last_used = self.step_count
        return steps

    def _steady_step(self, m: ModelState, max_steps: int | Bound = 1) -> StepPlan | None:
        """Nothing changed since a step that only decoded one model's batch (no arrival, no end, no
        memory freed): the full search would choose that batch again. Only the blocks its next
        tokens need are taken; None (and nothing changed) when they do not fit as they are."""
        growth, due = m.growth, []
        while growth and growth[0][0] <= m.steps:
            entry = heappop(growth)
            if entry[2].state == "running" and entry[2].due == entry[1]:
                due.append(entry)
        if due:
            if not self._fits_blocks(m, len(due)):
                for entry in due:
                    heappush(growth, entry)
                return None
            for _, _, req in due:
                req.blocks += 1
                self._schedule_growth(m, req)
            self._take_blocks(m, len(due))
        m.last_used = self.step_count
        batch = Batch(m.name, decode=list(m.running))  # before the run: requests it ends are in it
        steps = self._run(m, max_steps)
        plan = StepPlan(batches=[batch], steps=steps, repeats=max_steps == 1 and self._lasts(m, 1))
        plan.ends = self._ends
        return plan

    @staticmethod
    def _lasts(m: ModelState, steps: int) -> bool:
        """Does every running request of ``m`` still run after ``steps`` more steps (none makes its
        last token in them)?"""
        ends = m.ends
        while ends and (ends[0][2].state != "running" or ends[0][2].joined + ends[0][2].max_tokens != ends[0][0]):
            heappop(ends)  # ended or preempted since: an entry of a request that runs is live
        return bool(ends) and ends[0][0] - m.steps > steps

    def _run_length(self, m: ModelState, max_steps: int, through_ends: bool = False,
                    bound: Bound | None = None) -> int:
        """How many steps (at most ``max_steps``) the batch may run from now: none of its requests
        reaches its last token before the last step, and the blocks its later tokens need are
        taken now, in the order single steps would take them, up to the first that does not fit.
        ``through_ends``: the run may go on past the step where some of its requests make their last
        token, if the full search would then plan the rest of the batch again (``_keeps``): those
        requests end here, at once, and ``_ends`` says after how many steps. The run then goes on as
        far as a run that started there could: ``bound`` asked again for the batch left, or what was
        left of ``max_steps``."""
        ends, growth, base = m.ends, m.growth, m.steps
        stop = base + max_steps  # where the longest run allowed leaves ``m.steps``
        done: dict[str, int] | None = None
        stretches: list[tuple[int, int]] | None = None  # (steps, batch size) of each stretch before ``end``
        begun = base  # where this stretch began
        size = len(m.running)  # the batch of this stretch
        same_step: list[SchedRequest] = []  # granted a block for step ``at``: given back if that step is cut
        ties: list[int] = []  # the ties of their entries then
        block_tokens = self.config.block_tokens
        granted = base  # the growth entries up to this step are dealt with
        while True:
            while True:
                end, _, req = ends[0]
                if req.state == "running" and req.joined + req.max_tokens == end:
                    break
                heappop(ends)  # ended or preempted since: an entry of a request that runs is live
            upto = min(stop, end)  # this stretch ends there; nothing else takes or frees blocks meanwhile
            last = upto - 1
            room, taken = self._room(m), 0  # blocks that fit now
            # a stretch of a block's tokens or more: nearly every request needs a block in it, and one pass
            # over the heap beats an operation on it per block, where all of them fit (``_grant_all``)
            bulk = self._at_once and last - granted >= block_tokens and self._grant_all(m, last, room)
            granted = last
            at = -1
            same_step.clear()
            ties.clear()
            while not bulk and growth and growth[0][0] <= last:
                due, tie, req = growth[0]
                if req.state != "running" or req.due != tie:
                    heappop(growth)
                    continue
                if due != at:
                    at = due
                    if same_step:
                        same_step.clear()
                        ties.clear()
                if taken >= room:
                    for i, r in enumerate(same_step):  # the run ends before step ``due``: its blocks are not needed yet
                        r.blocks -= 1
                        r.due = ties[i]  # its entry is live again (the newer one pushed is stale)
                        heappush(growth, (due, ties[i], r))
                    if same_step:  # as single steps would: blocks given back, memory freed
                        self._epoch += 1
                    self._take_blocks(m, taken - len(same_step))
                    self._ends = done
                    return due - base  # the run ends before the token that needs it
                same_step.append(req)
                ties.append(tie)
                req.blocks += 1
                taken += 1
                heapreplace(growth, self._next_growth(req))  # its entry for the block after
            if not bulk:
                self._take_blocks(m, taken)
            if not through_ends or upto < end or end >= stop:
                self._ends = done
                return max(upto - base, 1)
            # Some requests make their last token at ``end`` and the run may go on: they end now, as the
            # engine would end them after that step, and the rest of the batch goes on if the full
            # search would plan it again then.
            if done is None:
                done = {}
            while ends and ends[0][0] == end:
                _, _, req = heappop(ends)
                if req.state == "running" and req.joined + req.max_tokens == end:
                    done[req.id] = end - base
                    self.finish(req.id)
            if not m.running or not self._keeps(m):
                self._ends = done
                return end - base
            if bound is not None:  # where a run starting at ``end`` would stop
                if stretches is None:
                    stretches = []
                stretches.append((end - begun, size))
                begun = end
                more = bound(m.name, len(m.running), None, stretches)
                stop = end + max(more, 1)
            size = len(m.running)

    def _grant_all(self, m: ModelState, last: int, room: int) -> bool:
        """Every block the running requests of ``m`` need up to step ``last``, if all of them fit in
        ``room``, at once: what granting them one at a time in the growth heap's order does, the ties
        included (False, and nothing changed, where they do not all fit).

        The ties: one entry is made per block granted, numbered in the order the heap hands entries out,
        and only each request's last entry stays. Entries of one step compare by tie, and a request's
        entries come every ``block_tokens`` steps, so only requests whose dues agree modulo that ever
        meet, and those granted here all end at the same step: there the order of a step's entries is its
        first entries (those made before, by tie) then those carried from the step a block before, in
        their order there. So the last entries go by their first due, latest first, then by tie; the
        numbers they get lie in the same range as one at a time would use, above every entry before."""
        growth, bt = m.growth, self.config.block_tokens
        need, due_now, later = 0, [], []
        for entry in growth:
            due, tie, req = entry
            if req.state != "running" or req.due != tie:
                continue  # stale (ended or preempted since): dropped here as a pop would drop it
            if due <= last:
                n = (last - due) // bt + 1
                need += n
                due_now.append((-due, tie, req, n))
            else:
                later.append(entry)
        if need > room:
            self.at_once[1] += 1
            return False
        self.at_once[0] += 1
        due_now.sort()  # by (first due, latest first; tie): ties differ, so the comparison ends there
        first = self._ties + need - len(due_now)  # the ties of the entries used up within the stretch come first
        self._ties += need
        for i, (_, _, req, n) in enumerate(due_now):
            req.blocks += n
            req.due = first + i
            later.append((req.blocks * bt - req.prompt_len + req.joined + 1, req.due, req))
        heapify(later)
        growth[:] = later
        self._take_blocks(m, need)
        return True

    def _schedule(self, now: float) -> StepPlan:
        self._fresh.clear()
        self._cut = False
        plan = StepPlan()
        room = [self.config.models_per_step] * len(self.budgets)  # batches each device may still take
        full = 0  # devices that can take no more
        claimed: set[str] = set()
        seen: list[tuple[float, ModelState]] = []
        # The oldest model that has nothing running: if memory held by running requests keeps it
        # from starting, every request newer than its head waits (the running models drain).
        hold_after: float | None = None
        # (a cast: read after the calls below, which may set it, the deadline is not known to be None)
        self.deadline = cast("float | None", None)
        if self.slo is not None:
            self._bound(plan, now)
        while (item := self._by_age(seen, len(seen))) is not None:
            key, m = item
            if not m.running and m.has_work:
                if not self._can_start(m) and self._busy_near(m):
                    oldest = m.oldest()
                    assert oldest is not None  # it has work
                    since = max(oldest, m.stopped_at)  # a model stopped for another waits anew
                    due = since + self.config.max_wait_s  # when it stops the others (preempt policy)
                    order = None
                    if self.slo is not None:  # or once its slack runs out, stopping those with more
                        slack = self.slo.slack(m, now)
                        due = min(due, now + max(slack, 0.0))
                        order = self._stoppable(m, slack, now)
                    if not (self.preempts and now >= due and self._switch_to(m, plan, now, order)):
                        hold_after = key
                        if self.preempts and (self.deadline is None or due < self.deadline):
                            self.deadline = due
                break
        i = 0
        while (item := self._by_age(seen, i)) is not None:
            key, m = item
            i += 1
            if full == len(room):
                break
            if not all(room[d] for d in m.devices):
                continue
            if hold_after is not None and key > hold_after and not m.on_device:
                continue  # it could admit nothing: do not take memory the older request waits for
            if self._yielded and self._yielding(m):
                continue
            if not self._make_resident(m, claimed, plan, plan.loads, now, evict_waiting=True):
                if self._memory_may_come(m):
                    hold_after = key if hold_after is None else hold_after
                else:  # nothing runs that will ever free memory for it
                    self._fail_head(m, plan, self._cannot_load_reason(m))
                continue
            batch = self._admit(m, plan, claimed, hold_after)
            if batch is None:  # blocked on KV cache held by others: everything newer waits for it
                if hold_after is None:
                    hold_after = key
                continue
            if batch.prefill or batch.decode:
                plan.batches.append(batch)
                self._held = hold_after  # the steady model's, where the plan has one batch
                claimed.add(m.name)
                for d in m.devices:
                    room[d] -= 1
                    full += not room[d]
                m.last_used = self.step_count
        if self.config.prefetch and self.counts_bytes:
            self._prefetch(plan, claimed, seen, now)
        for _, m in seen:
            self._queue(m)
        return plan

    def _stoppable(self, m: ModelState, slack: float, now: float) -> list[ModelState]:
        """Slo policy: running models on ``m``'s devices that may be stopped for it, most slack first:
        those whose slack, less a reload and a recompute, still exceeds ``m``'s."""
        dl, out = self.slo, {}
        assert dl is not None  # the slo policy's
        for d in m.devices:
            for c in self.on_device[d].values():
                if c is not m and c.running and not c.pinned and c.name not in out:
                    s = dl.slack(c, now) - dl.restart(c)
                    if s > slack:
                        out[c.name] = (s, c)
        return [c for _, c in sorted(out.values(), key=lambda e: -e[0])]

    def _bound(self, plan: StepPlan, now: float) -> None:
        """Slo policy: refuse the waiting requests whose work keeps others from their deadlines
        (``Deadlines.crowded``; each gets its reason in ``plan.failed``); a model whose head request
        has waited the bound goes first from now on (its key in the heap is -inf); a full search is
        due when the next head reaches the bound."""
        dl = self.slo
        assert dl is not None  # the slo policy's
        dl.now = now
        for m, r in dl.crowded([m for m in self.models.values() if m.has_work], now):
            plan.failed.append((r.id, dl.refusal(m, r, now)))
            self.finish(r.id)
        for m in self.models.values():
            if m.waiting and not m.waiting[0].done:
                self._queue(m)
                if not dl.past_bound(m):
                    t = m.waiting[0].arrival + dl.max_wait_s
                    self.deadline = t if self.deadline is None else min(self.deadline, t)

    def _prefetch(self, plan: StepPlan, claimed: set[str], seen: list[tuple[float, ModelState]], now: float) -> None:
        """Load the next model with work that is not on its devices, if it fits beside the busy ones."""
        i = 0
        while (item := self._by_age(seen, i)) is not None:
            _, m = item
            i += 1
            if not m.on_device and m.name not in claimed and m.has_work:
                if m.stuck_prefetch != self._epoch and not self._make_resident(
                        m, claimed, plan, plan.prefetch, now, evict_waiting=False):
                    m.stuck_prefetch = self._epoch
                return

    def _fail_head(self, m: ModelState, plan: StepPlan, why: str) -> None:
        for req in list(m.paused.values())[::-1]:  # they cannot resume either: they wait (first) and fail in turn
            self._preempt(m, req, plan)
        head = m.waiting[0]
        plan.failed.append((head.id, why))
        self.finish(head.id)

    def _preempt(self, m: ModelState, req: SchedRequest, plan: StepPlan) -> None:
        """Stop a running (or paused) request: free its blocks; it waits at the head of its queue and
        will recompute its cache (prompt and the tokens it made) when it runs again."""
        del (m.running if req.state == "running" else m.paused)[req.id]
        if req.state == "offloaded" and req.id in plan.kv_out:  # moved out by this plan: nothing to move
            plan.kv_out.remove(req.id)
        self._drop_blocks(m, req)
        req.done, req.state = m.steps - req.joined, "waiting"
        req.blocks = 0
        m.waiting.appendleft(req)
        plan.preempted.append(req.id)

    def _drop_blocks(self, m: ModelState, req: SchedRequest) -> None:
        """A running, paused or offloaded request gives up its blocks (on the devices, or in host memory)."""
        if req.state == "offloaded":
            self.host_used -= req.blocks * sum(m.block_bytes)
            return
        self._take_blocks(m, -req.blocks)
        self._hold(m, req, False)

    def _hold(self, m: ModelState, req: SchedRequest, joined: bool) -> None:
        """A request whose prompt's first blocks are shared with other choices started (or stopped)
        running: they are in its ``blocks``, but booked once, while any of those choices runs."""
        p = req.prefix
        if p is None or not p.blocks:
            return
        if joined:
            p.holders += 1
            if p.holders > 1:  # booked already
                self._take_blocks(m, -p.blocks)
        else:
            p.holders -= 1
            if p.holders:  # the others still hold them
                self._take_blocks(m, p.blocks)

    def _schedule_growth(self, m: ModelState, req: SchedRequest) -> None:
        """Note when the request's next token will not fit its blocks: at that step it needs another."""
        heappush(m.growth, self._next_growth(req))

    def _next_growth(self, req: SchedRequest) -> tuple[int, int, SchedRequest]:
        """The growth entry of the request's next block: (the step that needs it, tie, request)."""
        req.due = self._tie()  # names its live entry: entries left from before a preemption are stale
        return req.blocks * self.config.block_tokens - req.prompt_len + req.joined + 1, req.due, req

    def _grow(self, m: ModelState, req: SchedRequest, blocks: int, plan: StepPlan, keep: set[str]) -> bool:
        """Give a running request ``blocks`` more blocks: evict idle models, else preempt this
        model's newest running requests. False when ``req`` itself had to be preempted."""
        if not self._fits_blocks(m, blocks) and \
                not self._make_room(m, self._kv_need(m, blocks), keep, plan, evict_waiting=True):
            for victim in reversed(list(m.running.values())):
                self._preempt(m, victim, plan)
                if victim is req:
                    return False
                if self._fits_blocks(m, blocks):
                    break
        req.blocks += blocks
        self._take_blocks(m, blocks)
        return True

    def _admit(self, m: ModelState, plan: StepPlan, claimed: set[str], hold_after: float | None) -> Batch | None:
        """Running requests decode (each first gets the block its next token needs); waiting ones
        join while the batch, the token budget and memory allow. None: the head request waits for
        KV cache that running requests of other models hold."""
        cfg = self.config
        keep = claimed | {m.name}
        growth = m.growth
        while growth and growth[0][0] <= m.steps:  # only requests whose next token starts a block
            due, tie, req = heappop(growth)
            if req.state != "running" or req.due != tie:
                continue  # preempted or finished since
            if self._grow(m, req, 1, plan, keep):
                self._schedule_growth(m, req)
        had_running = bool(m.running) or bool(plan.preempted)
        batch = Batch(m.name, decode=list(m.running))
        if had_running and not m.running and plan.preempted and self._busy_near(m):
            return None  # all it had running was preempted for memory others hold: they drain first
        tokens = len(batch.decode)
        while m.waiting and len(m.running) < cfg.max_batch_size:
            req = m.waiting[0]
            if hold_after is not None and (req.arrival if self.slo is None else self.slo.due(req)) > hold_after:
                break  # drain: an older request of another model waits for this memory
            length = req.prompt_len + req.done
            if batch.prefill and tokens + length > cfg.max_tokens_per_step:
                self._cut = True
                break
            blocks = self._blocks(length)
            new = blocks - (req.prefix.blocks if req.prefix and req.prefix.holders else 0)
            if not self._fits_blocks(m, new) and \
                    not self._make_room(m, self._kv_need(m, new), keep, plan, evict_waiting=True):
                if m.running or batch.prefill or req.id in plan.preempted:
                    break
                if self._memory_may_come(m):
                    return None
                need = list(self._kv_need(m, new).values())
                self._fail_head(m, plan, f"request {req.id!r} needs {need} bytes of KV cache on "
                                         f"devices {list(m.devices)} and only "
                                         f"{[self.free_bytes(d) for d in m.devices]} can be freed")
                continue
            m.waiting.popleft()
            req.state, req.joined, req.done, req.blocks = "running", m.steps - req.done, 0, blocks
            m.running[req.id] = req
            self._take_blocks(m, blocks)
            self._hold(m, req, True)
            self._schedule_growth(m, req)
            heappush(m.ends, (req.joined + req.max_tokens, req.due, req))
            batch.prefill.append(req.id)
            tokens += length
        return batch
