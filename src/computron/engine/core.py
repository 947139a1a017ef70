"""EngineCore: the step loop over token ids; torch-free, with an injected clock.

What flows through: requests as token ids in, one token per running request per step out.
Each step is four calls: ``Scheduler.schedule(now)`` → ``Executor.apply`` (evictions, loads)
→ ``Executor.execute`` (one batch per model) → ``Scheduler.update``. A failure in a swap or a
batch fails the requests it touched, never the loop, and residency is repaired from what the
executor reports. The text layer (``Engine``) drives it; as nothing here needs torch or a real
clock, a simulated executor and a virtual clock can drive this same loop.

A request ends exactly once: on EOS or ``max_tokens`` here, on a stop string in the text layer,
on an error, or aborted. ``on_token(req, token)`` and ``on_finish(req)`` tell the layer above.

The choices of one prompt (``add_group``) share its cache: the first to prefill computes the whole
prompt; each other one starts from the prompt's whole blocks that a running choice holds (the
executor counts their holders) and computes only the rest, at most a block of tokens, which
also gives it the prompt's last logits to draw its own first token from. A choice that resumes
after a preemption does the same, or recomputes everything when no choice holds the blocks.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol, Sequence

from .._mypyc import mypyc_attr
from ..config import EngineConfig
from ..messages import ExecuteBatch, ModelInfo, Residency, SamplingParams, SeqInput, StepResult
from ..memory.units import staging_bytes
from ..scheduler import Batch, Bound, ModelCost, SchedRequest, Scheduler, SchedulerConfig, SharedPrefix, Slo, StepPlan
from .executor import Executor, executor_kind


class EngineError(ValueError):
    """Bad input from a user (unknown model, prompt too long, bad parameters): a 4xx, not a crash."""

_INT = {int}


@mypyc_attr(allow_interpreted_subclasses=True)  # the text layer's Request extends it
@dataclass(eq=False)
class CoreRequest:
    id: str
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    unavailable: bool = False  # the error is a lack of capacity or of a device (a server answers 503), not a bug
    first_token_at: float | None = None
    finished_at: float | None = None
    load_s: float = 0.0  # swap-in seconds of a load that ended in the step of its first token
    evict_s: float = 0.0  # eviction seconds of that step
    compute_s: float = 0.0  # seconds of the batches it took part in
    logprobs: list = field(default_factory=list)  # per output token, when its params ask: (logprob, top)
    prompt_logprobs: list | None = None  # per prompt token, when its params ask: None, then (logprob, top)
    group: "PromptGroup | None" = None  # the choices of its prompt, when there are several
    added: int = 0  # how many requests the core had taken before this one (set by ``add_request``)

    # Written out (the dataclass keeps it) so that the compiled build constructs requests natively:
    # mypyc leaves a generated ``__init__`` interpreted.
    def __init__(self, id: str, model: str, prompt_ids: list[int], params: SamplingParams, arrival: float = 0.0,
                 output_ids: list[int] | None = None, finish_reason: str | None = None, error: str | None = None,
                 unavailable: bool = False, first_token_at: float | None = None, finished_at: float | None = None,
                 load_s: float = 0.0, evict_s: float = 0.0, compute_s: float = 0.0, logprobs: list | None = None,
                 prompt_logprobs: list | None = None, group: "PromptGroup | None" = None, added: int = 0) -> None:
        self.id, self.model, self.prompt_ids, self.params, self.arrival = id, model, prompt_ids, params, arrival
        self.output_ids = [] if output_ids is None else output_ids
        self.finish_reason, self.error, self.unavailable = finish_reason, error, unavailable
        self.first_token_at, self.finished_at = first_token_at, finished_at
        self.load_s, self.evict_s, self.compute_s = load_s, evict_s, compute_s
        self.logprobs = [] if logprobs is None else logprobs
        self.prompt_logprobs, self.group, self.added = prompt_logprobs, group, added

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class PromptGroup:
    """The choices of one prompt. ``shared``: its tokens in whole blocks that the choices share (all
    but the last block, which has at least one token: each choice computes that one itself)."""

    members: list[CoreRequest]
    shared: int
    prefix: SharedPrefix  # the scheduler's booking of the shared blocks
    holders: dict[str, None] = field(default_factory=dict)  # choices whose cache holds those blocks now



class ColocationLink(Protocol):
    """What the core calls of a colocation link (``colocate.serving.EngineLink``)."""

    def poll(self) -> None:
        """Before a step: ask for the memory its work needs, apply budgets sent meanwhile."""

    def after_step(self) -> None:
        """After a step: report the devices' work (training may yield or take the compute)."""

class EngineCore:
    def __init__(self, executor: Executor, config: EngineConfig | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        cfg = config or EngineConfig()
        self.executor, self.clock = executor, clock
        st = executor.status()  # the executor's devices and KV block size are the truth
        # Under workers the scheduler lends the stripe devices' links load by load; the in-process
        # executor stripes every load through GPUs outside the engine by itself.
        stripe = tuple(cfg.stripe_devices) if executor_kind(cfg.executor, cfg.policy) == "workers" else ()
        try:
            self.scheduler = Scheduler(SchedulerConfig(
                budgets=tuple(d.capacity for d in st.devices), policy=cfg.policy, max_batch_size=cfg.max_batch_size,
                max_tokens_per_step=cfg.max_tokens_per_step, max_loaded=cfg.max_loaded, prefetch=cfg.prefetch,
                models_per_step=cfg.models_per_step,
                block_tokens=st.kv_block_tokens, max_wait_s=cfg.max_wait_s, preempt_keeps_kv=cfg.preempt_keeps_kv,
                slo_scale=cfg.slo_scale, kv_host_bytes=cfg.kv_host_bytes, stripe_devices=stripe,
                stripe_staging=staging_bytes(int(cfg.stripe_chunk_bytes)) if stripe else 0,
                prefill_runs=st.prefill_runs, end_runs=st.end_runs))
        except ValueError as e:
            raise EngineError(str(e)) from None
        self._slo_config = cfg  # slo policy: the SLOs given and the calibration of the costs
        self.slo_calibration = cfg.slo_calibration or (  # none given: the built-in one of the device kind
            "cpu" if all(d.name == "cpu" for d in st.devices) else "h200-rough")
        self.slo_counts: dict[str, list[int]] = {}  # slo policy: model -> [requests within their SLO, requests]
        self.models: dict[str, ModelInfo] = {}
        self.requests: dict[str, CoreRequest] = {}
        self._ids = itertools.count()
        self.added = 0  # requests taken so far (``add_request``): a request's ``added`` orders it among them
        self.ended = 0  # requests ended so far (``finish``)
        self._to_free: list[str] = []
        self.stats = {"swap_ins": 0, "evictions": 0, "swap_in_bytes": 0, "swap_in_seconds": 0.0, "steps": 0,
                      "preemptions": 0, "pauses": 0,  # pauses: stopped with their caches kept (no recompute)
                      "prefill_tokens": 0,  # tokens computed by prefills (recomputes included)
                      "shared_steps": 0}  # steps that ran batches of several models on one device
        self._shares = cfg.models_per_step > 1  # a step may run several models' batches on one device
        # listener(kind, model, seconds, nbytes), kind "load" (once its copies ended) or "evict"
        self.listeners: list[Callable[[str, str, float, int], None]] = []
        self.on_token: Callable[[CoreRequest, int], None] | None = None
        self.on_finish: Callable[[CoreRequest], None] | None = None
        self.trace = False  # ask the executor for a per-layer copy/compute trace of the next batches
        self.last_trace: dict[str, dict] = {}
        # An optional arbiter link (computron.colocate.serving.EngineLink): its poll() runs before each
        # step; it asks for the memory the work needs and sets budgets through set_budget.
        self.colocation: ColocationLink | None = None

    # ---- models --------------------------------------------------------------------------------
    def add_model(self, info: ModelInfo, pinned: bool = False, cost: ModelCost | None = None) -> None:
        """Register a model the executor has; ``cost`` (slo policy): its load, prefill and decode
        seconds (default: from the configured calibration)."""
        if info.name in self.models:
            raise EngineError(f"a model named {info.name!r} is already registered")
        try:
            slo = None
            if self.scheduler.slo is not None:
                cfg = self._slo_config
                if cost is None:
                    from ..sim.costs import calibration

                    cost = ModelCost.from_calibration(calibration(self.slo_calibration), info.weight_bytes,
                                                      info.placement.devices, tuple(cfg.stripe_devices))
                slo = Slo.solo(cost, cfg.slo_scale)  # what the config gives replaces these
                slo = Slo(**{**asdict(slo), **{k: float(v) for k, v in cfg.slos.get(info.name, {}).items()}})
                self.slo_counts[info.name] = [0, 0]
            self.scheduler.add_model(info.name, info.weight_bytes, info.kv_bytes_per_token,
                                     info.placement.devices, pinned, cost, slo)
        except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
            self.executor.unregister(info.name)
            raise EngineError(str(e)) from None
        self.models[info.name] = info

    def remove_model(self, name: str) -> None:
        self.info(name)
        try:
            self.scheduler.remove_model(name)  # refuses while requests are in flight
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.executor.unregister(name)
        del self.models[name]

    def info(self, name: str) -> ModelInfo:
        try:
            return self.models[name]
        except KeyError:
            raise EngineError(f"unknown model {name!r}; known models: {', '.join(self.models) or 'none'}") from None

    def model_state(self, name: str) -> str:
        """offloaded | loading | resident (a load ends when the executor says its copies are done)."""
        self.info(name)
        state = self.scheduler.state(name)
        if state == "loading" and self.executor.status().models.get(name) == "resident":
            self.scheduler.loaded(name)
            state = "resident"
        return state

    def model_stats(self, name: str) -> dict:
        out = {**self.scheduler.model_stats(self.info(name).name), "state": self.model_state(name)}
        if name in self.slo_counts:
            out["slo_met"], out["slo_requests"] = self.slo_counts[name]
        return out

    def load(self, name: str, wait: bool = False) -> None:
        """Admin: put a model on its devices now, evicting idle ones as the scheduler would;
        with ``wait``, return once its copies have ended."""
        self.info(name)
        try:
            plan = self.scheduler.plan_load(name, self.clock())
        except ValueError as e:
            raise EngineError(str(e)) from None
        self._apply(plan)
        if wait:
            self._loaded(self.executor.wait_loads())

    def offload(self, name: str) -> None:
        self.info(name)
        if self.scheduler.state(name) == "offloaded":
            return
        try:
            self.scheduler.offloaded(name)
        except ValueError as e:
            raise EngineError(str(e)) from None
        self._evict([name])

    def set_pinned(self, name: str, pinned: bool) -> None:
        self.scheduler.set_pinned(self.info(name).name, pinned)

    # ---- requests ------------------------------------------------------------------------------
    def new_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, req: CoreRequest, ids_checked: bool = False) -> CoreRequest:
        """Validate a request's token ids against its model and queue it. ``ids_checked``: the caller
        made the ids itself and knows them valid (the simulator: checking costs ~20 us a prompt)."""
        cfg = self.info(req.model).config
        ids, max_tokens = req.prompt_ids, req.params.max_tokens
        if not ids:
            raise EngineError("the prompt is empty")
        if not ids_checked and (not set(map(type, ids)) <= _INT or min(ids) < 0 or  # C loops: long prompts
                                max(ids) >= cfg.vocab_size):
            raise EngineError(f"prompt token ids must be integers in [0, {cfg.vocab_size})")
        if len(ids) + max_tokens > cfg.max_position:
            raise EngineError(
                f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: together "
                f"{len(ids) + max_tokens}, {len(ids) + max_tokens - cfg.max_position} more than the context of "
                f"{cfg.max_position} tokens of {req.model!r}")
        if req.id in self.requests:
            raise EngineError(f"request id {req.id!r} is already in use")
        try:
            self.scheduler.add_request(SchedRequest(req.id, req.model, len(ids), max_tokens, req.arrival,
                                                    prefix=req.group.prefix if req.group else None))
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.requests[req.id] = req
        req.added, self.added = self.added, self.added + 1
        return req

    def add_group(self, reqs: list[CoreRequest]) -> list[CoreRequest]:
        """Queue the choices of one prompt (same model and prompt ids), sharing its cache; all or none."""
        bt = self.scheduler.config.block_tokens
        shared = (len(reqs[0].prompt_ids) - 1) // bt * bt
        group = PromptGroup(reqs, shared, SharedPrefix(shared // bt))
        done: list[CoreRequest] = []
        try:
            for r in reqs:
                if r.model != reqs[0].model or r.prompt_ids != reqs[0].prompt_ids:
                    raise EngineError("the choices of a group must have the same model and prompt")
                r.group = group
                done.append(self.add_request(r))
        except BaseException:
            for r in done:
                self.abort(r.id)
            raise
        return reqs

    def abort(self, req_id: str, reason: str = "abort", error: str | None = None) -> None:
        req = self.requests.get(req_id)
        if req is not None and not req.done:
            self.finish(req, reason, error)
            self._flush_frees()

    def has_work(self) -> bool:
        return bool(self.requests)

    def finish(self, req: CoreRequest, reason: str, error: str | None = None, unavailable: bool = False,
               at: float | None = None) -> None:
        """``at``: when it ended, if not now (a run's request that made its last token before the run's end)."""
        if req.done:
            return
        req.finish_reason, req.error, req.finished_at = reason, error, self.clock() if at is None else at
        req.unavailable = unavailable
        self.ended += 1
        self.requests.pop(req.id, None)
        if req.group is not None:
            req.group.holders.pop(req.id, None)
        slo = self.scheduler.slo
        if slo is not None and req.model in self.slo_counts and reason != "abort":
            self._count_slo(req, slo.slos[req.model])
        self.scheduler.finish(req.id)
        self._to_free.append(req.id)
        if self.on_finish:
            self.on_finish(req)

    def _count_slo(self, req: CoreRequest, slo: Slo) -> None:
        """Did the request end within its model's SLO (completed and ``Slo.met``)? An error or a
        refusal misses."""
        counts = self.slo_counts[req.model]
        counts[1] += 1
        if req.finish_reason in ("stop", "length") and req.first_token_at is not None and \
                req.finished_at is not None and slo.met(req.arrival, req.first_token_at, req.finished_at,
                                                        len(req.output_ids)):
            counts[0] += 1

    def _fail(self, req_ids, why: str, unavailable: bool = False) -> None:
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.finish(req, "error", why, unavailable)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, max_steps: int | Bound = 1) -> StepPlan:
        """One iteration: schedule, swap, execute one batch per model, update. The KV caches of
        requests that ended are released in one message at the end. ``max_steps`` > 1 lets a steady
        decode batch run that many steps in one call (``plan.steps``; see ``Scheduler.schedule``, which
        also takes a function of the batch): the caller promises no request arrives meanwhile."""
        try:
            return self._step(max_steps)
        finally:
            self._flush_frees()
            if self.colocation is not None:
                self.colocation.after_step()

    def _count_shared(self, batches) -> None:
        """Count the step in ``shared_steps`` if two of its batches run on one device."""
        seen: set[int] = set()
        for b in batches:
            devices = self.models[b.model].placement.devices
            if not seen.isdisjoint(devices):
                self.stats["shared_steps"] += 1
                return
            seen.update(devices)

    def _step(self, max_steps: int | Bound = 1) -> StepPlan:
        if self.colocation is not None:
            self.colocation.poll()
        ended = self.ended
        plan = self.scheduler.schedule(self.clock(), max_steps)
        for rid, why in plan.failed:  # it can never fit next to what is pinned: capacity, not a bug
            self._fail([rid], why, unavailable=True)
        evict_s = self._apply(plan)
        reqs = self.requests
        # the scheduler plans only requests the core holds: the batches need sifting only if some ended since
        batches = plan.batches if self.ended == ended else \
            [b for b in plan.batches if all(map(reqs.__contains__, b.requests))]
        if not batches:
            return plan
        self.stats["steps"] += plan.steps
        if self._shares and len(batches) > 1:
            self._count_shared(batches)
        msgs = [ExecuteBatch(b.model, [self._prefill(reqs[rid]) for rid in b.prefill] + [self._decode(reqs[rid])
                                                                                        for rid in b.decode],
                             self.trace, plan.steps, plan.repeats, plan.ends)
                for b in batches]
        try:
            result = self.executor.execute(msgs).result()
        except Exception as e:  # a failed step fails its requests, never the engine
            for b in batches:
                self._fail(b.requests, f"execution failed: {type(e).__name__}: {e}")
            return plan
        self._absorb(result, batches, evict_s)
        self.scheduler.update(plan, plan.steps)
        return plan

    @staticmethod
    def _decode(r: CoreRequest) -> SeqInput:
        """The last token, after the tokens already in the cache."""
        ids = r.output_ids
        return SeqInput(r.id, ids[-1:], len(r.prompt_ids) + len(ids) - 1, r.params)

    def _prefill(self, r: CoreRequest) -> SeqInput:
        """The whole prompt; after a preemption, the prompt and the tokens made so far (recompute).
        A choice of a prompt whose shared blocks another choice holds computes only the rest; the
        prompt's log-probabilities are asked for once."""
        tokens = r.prompt_ids + r.output_ids if r.output_ids else r.prompt_ids  # not copied (executors only read it)
        share, g = None, r.group
        if g is not None:
            holder = next(iter(g.holders), None)
            if holder is not None and g.shared:
                share = (holder, g.shared)
            g.holders[r.id] = None
        want = r.params.prompt_logprobs if share is None and r.prompt_logprobs is None else None
        self.stats["prefill_tokens"] += len(tokens) - (share[1] if share else 0)
        return SeqInput(r.id, tokens, 0, r.params, share, want)

    def _loaded(self, loaded: dict[str, float]) -> None:
        for name, s in loaded.items():
            self.scheduler.loaded(name)
            self.stats["swap_in_seconds"] += s
            self._notify("load", name, s)

    def _absorb(self, result: StepResult, batches: list[Batch], evict_s: float) -> None:
        self._loaded(result.loaded)
        self.last_trace = result.trace
        for rid, why in result.failed.items():  # first: the executor's own reason (e.g. which worker died)
            self._fail([rid], why, unavailable=bool(result.lost_devices))
        requeued = self._lose(result.lost_devices, result.reset_devices) \
            if result.lost_devices or result.reset_devices else ()
        for rid, lps in result.prompt_logprobs.items():
            r, lps = self.requests.get(rid), [None] + lps
            if r is not None:
                for c in r.group.members if r.group else (r,):
                    c.prompt_logprobs = lps
        now = self.clock()
        reqs, out, logprobs, first_at = self.requests, result.tokens, result.logprobs, result.first_at
        ended_at = result.ended_at  # requests that ended before the run's last step: when
        plain = not logprobs and self.on_token is None  # tokens can go in at once (as _append would)
        for b in batches:
            compute = result.compute_s.get(b.model, 0.0)
            loaded = result.loaded.get(b.model, 0.0)
            eos = self.models[b.model].config.eos_token_id
            first = now if first_at is None else first_at.get(b.model, now)
            for rids in (b.prefill, b.decode):  # b.requests, without making that list
                for rid in rids:
                    r = reqs.get(rid)
                    tokens = out.get(rid)
                    if r is None or tokens is None or rid in requeued:  # requeued: it recomputes them
                        continue
                    r.compute_s += compute
                    ids = r.output_ids
                    if not ids:
                        r.first_token_at, r.load_s, r.evict_s = first, loaded, evict_s
                    at = None if ended_at is None else ended_at.get(rid)
                    if not plain:
                        if isinstance(tokens, int):
                            self._append(r, tokens, logprobs.get(rid), at)
                        else:
                            self._extend(r, tokens, logprobs.get(rid), at)
                    elif isinstance(tokens, int):
                        if tokens == eos and not r.params.ignore_eos:
                            self.finish(r, "stop", at=at)
                        else:
                            ids.append(tokens)
                            if len(ids) >= r.params.max_tokens:
                                self.finish(r, "length", at=at)
                    elif r.params.ignore_eos or eos not in tokens:
                        room = r.params.max_tokens - len(ids)
                        ids.extend(tokens[:room] if room < len(tokens) else tokens)
                        if room <= len(tokens):
                            self.finish(r, "length", at=at)
                    else:
                        self._extend(r, tokens, None, at)

    def _append(self, r: CoreRequest, token: int, logprob=None, at: float | None = None) -> None:
        """One token; ``at``: when the request's last step ended, should this token end it."""
        eos = self.models[r.model].config.eos_token_id
        if token == eos and not r.params.ignore_eos:
            self.finish(r, "stop", at=at)
            return
        r.output_ids.append(token)
        if logprob is not None:
            r.logprobs.append(logprob)
        if self.on_token:
            self.on_token(r, token)  # may end it (a stop string)
        if not r.done and len(r.output_ids) >= r.params.max_tokens:
            self.finish(r, "length", at=at)

    def _extend(self, r: CoreRequest, tokens: list[int], logprobs: Sequence | None = None,
                at: float | None = None) -> None:
        """The tokens of a run of several steps one at a time (with their log-probabilities, when
        asked, or to be seen one by one); those after the request ended are dropped."""
        for i, t in enumerate(tokens):
            self._append(r, t, logprobs[i] if logprobs is not None else None, at)
            if r.done:
                return

    def _lose(self, lost: list[int], reset: Sequence[int] = ()) -> set[str]:
        """Devices died (``lost``) or were restarted with them (``reset``): the models on them are off
        their devices now. The requests that needed a dead worker were failed by the executor
        (``StepResult.failed``); every other running request of those models waits again and
        recomputes its cache; waiting requests wait on, and their models come back when next
        scheduled. Returns the requeued requests: tokens the step made for them are dropped."""
        gone, requeued = set(lost) | set(reset), set()
        for name, info in self.models.items():
            if gone.intersection(info.placement.devices):
                requeued.update(self.scheduler.requeue(name))
                if self.scheduler.state(name) != "offloaded":
                    self.scheduler.offloaded(name)
        self._preempted(requeued)
        return requeued

    def _preempted(self, req_ids) -> None:
        """Requests stopped to recompute later: their caches (and shares of a prompt's blocks) are gone."""
        self.stats["preemptions"] += len(req_ids)
        for rid in req_ids:
            g = getattr(self.requests.get(rid), "group", None)
            if g is not None:
                g.holders.pop(rid, None)

    # ---- residency -----------------------------------------------------------------------------
    def _apply(self, plan: StepPlan) -> float:
        """Evictions, then loads; returns eviction seconds. A failed load fails the requests of its
        batch, and the scheduler is told what really is on the devices."""
        self._flush_frees()
        if not (plan.evictions or plan.loads or plan.prefetch or plan.preempted or plan.kv_out or plan.kv_in):
            return 0.0
        loads = plan.loads + plan.prefetch
        self._preempted(plan.preempted)  # their caches are released below
        self.stats["pauses"] += len(plan.paused)  # theirs stay: the executor evicts weights only
        if plan.kv_out or plan.kv_in:  # caches moved to host memory and back (requests; bytes both ways),
            st = self.stats  # counted once it happens (the counters of a run without any stay as they were)
            st["kv_offloaded"] = st.get("kv_offloaded", 0) + len(plan.kv_out)
            st["kv_restored"] = st.get("kv_restored", 0) + len(plan.kv_in)
            st["kv_moved_bytes"] = self.scheduler.kv_moved_bytes
        try:
            evicted = self.executor.apply(Residency(list(plan.evictions), loads, list(plan.preempted),
                                                    list(plan.kv_out), list(plan.kv_in), dict(plan.stripes)))
        except Exception as e:  # a swap that fails fails its requests, never the engine
            present = self.executor.status().models
            why = f"swap failed: {type(e).__name__}: {e}"
            for b in plan.batches:
                if b.model not in present:
                    self._fail(b.requests, why, unavailable=True)
            for name in loads:
                if name not in present and self.scheduler.state(name) != "offloaded":
                    self.scheduler.offloaded(name)
            evicted = {n: 0.0 for n in plan.evictions}
            loads = [n for n in loads if n in present]
        for name, s in evicted.items():
            self.stats["evictions"] += 1
            self._notify("evict", name, s)
        for name in loads:
            self.stats["swap_ins"] += 1
            self.stats["swap_in_bytes"] += self.models[name].total_bytes
            if name in plan.stripes:  # through helpers' links too (counted once it happens)
                self.stats["striped_swap_ins"] = self.stats.get("striped_swap_ins", 0) + 1
        return sum(evicted.values())

    def set_budget(self, device: int, nbytes: int) -> None:
        """Colocation: inference may use ``nbytes`` of ``device`` from now on; idle models beyond it
        are evicted and the executor's arena follows (``fit_memory``)."""
        grow = nbytes > self.scheduler.shares[device]
        if grow:  # the memory is there before the scheduler books it
            self.executor.resize(device, min(nbytes, self.scheduler.budgets[device]))
        self._apply(self.scheduler.set_budget(device, nbytes))
        if not grow:
            self.fit_memory(device)

    def fit_memory(self, device: int) -> int:
        """Shrink the executor's arena on ``device`` to inference's share (or to what running requests
        still hold, until they end), returning the rest to the device; the arena's new size."""
        self._flush_frees()
        return self.executor.resize(device, self.scheduler.shares[device])

    def _evict(self, names: list[str]) -> None:
        self._flush_frees()
        for name, s in self.executor.apply(Residency(evict=names)).items():
            self.stats["evictions"] += 1
            self._notify("evict", name, s)

    def _flush_frees(self) -> None:
        if self._to_free:
            ids, self._to_free = self._to_free, []
            self.executor.free(ids)

    def _notify(self, kind: str, model: str, seconds: float) -> None:
        for fn in self.listeners:
            fn(kind, model, seconds, self.models[model].total_bytes)

    def memory(self) -> dict:
        """Bytes per device as the executor holds them, beside the scheduler's accounting."""
        st = self.executor.status()
        return {"devices": [{"device": d.name, "budget": d.budget, "capacity": d.capacity,
                             "share": self.scheduler.shares[d.index], "weights": d.weights, "kv": d.kv,
                             "held": d.capacity if d.held < 0 else d.held,
                             "scheduled": d.capacity - self.scheduler.free_bytes(d.index),
                             "compactions": d.compactions} for d in st.devices],
                "weights": sum(d.weights for d in st.devices), "kv": sum(d.kv for d in st.devices),
                "total": sum(d.capacity for d in st.devices), "budget": sum(d.budget for d in st.devices)}
