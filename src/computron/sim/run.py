"""simulate(): a workload through the real ``EngineCore`` and ``Scheduler``, on a ``SimExecutor``
and a ``VirtualClock``. Nothing of the step loop is copied: the core steps as it does in a server.

The loop: requests whose arrival time has come are added to the core (with their arrival as the
core's ``arrival``, so the scheduler orders them as it would); if the core has nothing to do the
clock jumps to the next arrival, else the core takes one step (which moves the clock by the
modelled swap and compute times). A request's first-token and finish times are the clock's time
at the end of the step that produced them, as in the engine.

Probes first (``Simulation.probe``): as ``computron loadgen`` measures each model's solo latency
before it replays a trace against a server, a warm-up request and a probe per model run alone first,
so the trace starts with the models resident (and, under the legacy executor, the host copies
page-locked) that the measured run started with.

Fast-forward: when the scheduler's plan only decodes one model's batch, or admits requests to it
while what stopped admission holds (the simulated executor runs a first step that prefills them and
then decode steps), the core is allowed a run of as many steps as end before the next arrival that
could change a plan (one that only waits behind others of its model cannot:
``Scheduler.joins_queue``); ``Scheduler.schedule(max_steps=...)`` stops it earlier where a request
ends or a block does not fit. The same decisions and times as single steps, at a fraction of the
calls; requests that arrived during a run are added after it.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..config import EngineConfig, ModelSpec
from ..engine.core import CoreRequest, EngineCore
from ..messages import ModelDescription, SamplingParams
from ..scheduler import Bound, ModelCost, StepPlan
from ..workload.report import by_model
from .clock import VirtualClock
from .costs import CPU_DEFAULT, Calibration
from .executor import SimExecutor

FAST_FORWARD_MAX = 4096  # steps of one run at most
ARRIVALS_AHEAD = 16  # arrivals looked at for one run: a run ends at the next after those, quiet or not


@dataclass(frozen=True)
class Arrival:
    """One request of a workload (any object with these four attributes, or a 4-tuple, will do)."""

    time: float
    model: str
    prompt_tokens: int
    output_tokens: int

    # Written out (the dataclass keeps it; frozen, so through object.__setattr__): the compiled build
    # then makes one natively, where the generated __init__ runs interpreted, ~15x slower.
    def __init__(self, time: float, model: str, prompt_tokens: int, output_tokens: int) -> None:
        object.__setattr__(self, "time", time)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "prompt_tokens", prompt_tokens)
        object.__setattr__(self, "output_tokens", output_tokens)


@dataclass
class RequestRecord:
    id: str
    model: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    first_token: float | None
    finish: float | None
    finish_reason: str | None
    error: str | None = None
    step: int = 0  # how many scheduling steps the core had taken when the request was added

    # Written out (the dataclass keeps it): one record is made per request, and the compiled build
    # makes them natively only with an ``__init__`` of the class's own.
    def __init__(self, id: str, model: str, arrival: float, prompt_tokens: int, output_tokens: int,
                 first_token: float | None, finish: float | None, finish_reason: str | None,
                 error: str | None = None, step: int = 0) -> None:
        self.id, self.model, self.arrival, self.prompt_tokens, self.output_tokens = (id, model, arrival,
                                                                                     prompt_tokens, output_tokens)
        self.first_token, self.finish, self.finish_reason, self.error, self.step = (first_token, finish,
                                                                                    finish_reason, error, step)

    @property
    def latency(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def ok(self) -> bool:
        return self.finish_reason in ("length", "stop")


@dataclass
class SimResult:
    records: list[RequestRecord]
    end_time: float  # the clock when the last request ended
    steps: int  # executed steps
    stats: dict = field(default_factory=dict)  # the core's counters (swap_ins, evictions, ...)
    wall_s: float = 0.0  # real seconds the simulation took

    def summary(self) -> dict:
        """Latency and time to first token (mean, p50, p99) over all requests and per model."""
        out = by_model(self.records)
        out["end_time"], out["steps"], out["stats"] = self.end_time, self.steps, dict(self.stats)
        return out


def _arrivals(trace) -> list[Arrival]:
    """The trace as ``Arrival``s, by time."""
    out: list[Arrival] = []
    for a in trace:
        if isinstance(a, tuple):
            time, model, prompt_tokens, output_tokens = a
            out.append(Arrival(time, model, prompt_tokens, output_tokens))
        elif isinstance(a, Arrival):
            out.append(a)
        else:
            out.append(Arrival(a.time, a.model, a.prompt_tokens, a.output_tokens))
    out.sort(key=lambda a: a.time)  # stable: equal times keep their order
    return out


class Simulation:
    """An EngineCore on a SimExecutor and a VirtualClock, with models registered; ``run`` feeds a trace.

    Hooks for tests: ``step`` (the core's step, which a run calls: wrap it to see every call; the
    compiled core's own methods cannot be replaced)."""

    def __init__(self, models: Iterable, calibration: Calibration = CPU_DEFAULT,
                 engine_config: EngineConfig | None = None, devices: int = 1, fast_forward: bool = True):
        self.fast_forward = fast_forward  # steady decode runs several steps per core call (same outcome)
        self.config = engine_config or EngineConfig()
        self.clock = VirtualClock()
        self.executor = SimExecutor(self.config, calibration, self.clock, devices)
        self.core = EngineCore(self.executor, self.config, self.clock)  # type: ignore[arg-type]  # _Done: a Future
        self.core.on_finish = self._finished
        self.step: Callable[..., StepPlan] = self.core.step
        self.records: dict[str, RequestRecord] = {}
        self._params: dict[int, SamplingParams] = {}
        self._prompts: dict[str, dict[int, list[int]]] = {}  # model -> prompt length -> its prompt (shared)
        self.schedule_calls = 0  # core steps (``EngineCore.step`` calls) that runs have made
        self.origin = 0.0  # the clock when the trace starts: times in records are relative to it
        for m in models:
            spec = ModelSpec.parse(m) if isinstance(m, str) else m
            desc = ModelDescription(spec.name, spec.source, spec.dtype, spec.seed)
            info = self.executor.register(desc)  # the slo policy's costs are the calibration's
            self.core.add_model(info, spec.pinned, ModelCost.from_calibration(
                calibration, info.weight_bytes, info.placement.devices, self.executor.stripe))

    def solo_latency(self, trace) -> dict[str, float]:
        """Each model's latency for its median request (prompt and output tokens of ``trace``) alone
        on its device, warm: the base of an SLO given as a multiple of solo latency."""
        from .timing import batch_time

        out = {}
        for name, m in self.executor.models.items():
            mine = sorted((a.prompt_tokens, a.output_tokens) for a in _arrivals(trace) if a.model == name)
            if not mine:
                continue
            p = sorted(x for x, _ in mine)[len(mine) // 2]
            o = sorted(y for _, y in mine)[len(mine) // 2]
            cal = self.executor.cal
            out[name] = batch_time(cal, m.nbytes, p, 0) + (o - 1) * batch_time(cal, m.nbytes, 0, 1)
        return out

    def probe(self, trace) -> dict[str, float]:
        """What ``computron loadgen`` sends before it replays ``trace`` (``workload.loadgen.solo_latency``):
        per model of the trace, in name order, a warm-up request of its median prompt and 2 tokens, then
        one of its median prompt and output lengths, each alone, once the one before has ended. The
        trace ``run`` is given next starts where they end (its times and the records' are relative to
        that), with the models they left resident; ``run``'s counters leave them out, as loadgen reads
        the server's counters over the replay only. Returns each model's probe latency (loadgen's SLO base)."""
        arrivals = _arrivals(trace)
        out = {}
        for name in sorted({a.model for a in arrivals}):
            mine = [a for a in arrivals if a.model == name]
            p = sorted(a.prompt_tokens for a in mine)[len(mine) // 2]
            o = sorted(a.output_tokens for a in mine)[len(mine) // 2]
            for tokens in (2, o):
                rid = f"probe-{name}-{tokens}"
                self._add(0, Arrival(self.clock.t, name, p, tokens), rid)
                while self.core.requests:
                    if not self.step().batches and not self.executor.wait_loads():
                        raise RuntimeError(f"simulation stalled at t={self.clock.t} in the probe {rid!r}")
                rec = self.records.pop(rid)
                if not rec.ok:
                    raise RuntimeError(f"the probe {rid!r} failed: {rec.error}")
            latency = rec.latency
            assert latency is not None  # it ended (ok)
            out[name] = latency
        self.origin = self.clock.t
        return out

    def _finished(self, req: CoreRequest) -> None:
        rec = self.records[req.id]
        rec.first_token, rec.finish, rec.finish_reason, rec.error = (req.first_token_at, req.finished_at,
                                                                     req.finish_reason, req.error)

    def _add(self, i: int, a: Arrival, rid: str | None = None) -> None:
        n = a.output_tokens
        params = self._params.get(n)
        if params is None:
            params = self._params[n] = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        prompts = self._prompts.get(a.model)
        if prompts is None:
            prompts = self._prompts[a.model] = {}
        prompt = prompts.get(a.prompt_tokens)
        if prompt is None:
            prompt = prompts[a.prompt_tokens] = [self.executor.models[a.model].token] * a.prompt_tokens \
                if a.model in self.executor.models else [0] * a.prompt_tokens
        rid = rid or f"r{i}"
        rec = self.records[rid] = RequestRecord(rid, a.model, a.time, a.prompt_tokens, n, None, None, None,
                                                step=self.core.scheduler.step_count)
        try:
            self.core.add_request(CoreRequest(rid, a.model, prompt, params, arrival=a.time), ids_checked=True)
        except ValueError as e:  # EngineError: the request is refused, as a server would answer 4xx
            rec.finish_reason, rec.error = "error", str(e)

    def _run_bound(self, arrivals: list[Arrival], i: int, cap: int, capped: bool) -> Bound:
        """The bound of a run of decode steps, for the scheduler to ask once it knows the batch: as
        many steps as end before the first arrival from ``arrivals[i]`` on that would change a plan
        (one that only joins a queue behind others does not), and before the preempt policy's
        deadline. After the stretches ``before`` of a run that goes on past some of its requests'
        ends: what a run starting there would be given, the arrivals until then queued (each joined
        its queue, or the run would have stopped before it) and the cap counted afresh (less the
        steps made, where ``capped``: a run of so many steps in all)."""
        sched, n, executor = self.core.scheduler, len(arrivals), self.executor

        def bound(model: str, batch: int, prefill: tuple[int, int] | None, before: list[tuple[int, int]]) -> int:
            j, limit = i, cap
            joins: set[str] = set()  # models whose first arrival here joins: their later ones do too
            if before:
                t = executor.after_stretches(model, before)
                while j < n and arrivals[j].time <= t:
                    joins.add(arrivals[j].model)
                    j += 1
                if capped:
                    limit = max(1, cap - sum(k for k, _ in before))
            stop = min(n, j + ARRIVALS_AHEAD)
            while j < stop:
                a = arrivals[j]
                if a.model not in joins:
                    if not sched.joins_queue(a.model, a.time):
                        break
                    joins.add(a.model)
                j += 1
            until = arrivals[j].time if j < n else math.inf
            if sched.deadline is not None:  # a full search is due then
                until = min(until, sched.deadline)
            return executor.steps_before(model, batch, until, limit, prefill, before)

        return bound

    def run(self, trace, max_steps: int | None = None) -> SimResult:
        t0 = time.perf_counter()
        collecting = gc.isenabled()
        gc.disable()  # the loop makes almost no cycles (3k objects in 20k requests); the collector's
        try:  # passes over the growing records cost ~7% of a run
            return self._run(trace, max_steps, t0)
        finally:
            if collecting:
                gc.enable()

    def _run(self, trace, max_steps: int | None, t0: float) -> SimResult:
        arrivals, origin = _arrivals(trace), self.origin
        if origin:
            arrivals = [Arrival(a.time + origin, a.model, a.prompt_tokens, a.output_tokens) for a in arrivals]
        clock, core, step = self.clock, self.core, self.step
        before, earlier = dict(core.stats), set(self.records) if origin else ()
        n, i, steps, idle = len(arrivals), 0, 0, 0
        while True:
            now = clock.t
            while i < n and arrivals[i].time <= now:
                self._add(i, arrivals[i])
                i += 1
            if not core.requests:
                if i >= n:
                    break
                clock.advance_to(arrivals[i].time)
                continue
            k: int | Bound = 1
            if self.fast_forward:
                cap = FAST_FORWARD_MAX if max_steps is None else max(1, max_steps - steps)
                k = self._run_bound(arrivals, i, cap, max_steps is not None)
            plan = step(k)
            self.schedule_calls += 1
            if plan.batches:
                steps, idle = steps + plan.steps, 0
            else:  # nothing ran: time must move (an arrival, or copies landing), or we are stuck
                idle += 1
                if i < n:
                    clock.advance_to(arrivals[i].time)
                elif core.executor.wait_loads() or idle < 3:
                    pass
                else:
                    raise RuntimeError(f"simulation stalled at t={clock.t}: {len(core.requests)} requests "
                                       f"outstanding and no step runs")
            if max_steps is not None and steps >= max_steps:
                break
        stats = {k: v - before[k] if k in before and isinstance(v, (int, float)) else v
                 for k, v in core.stats.items()}  # this trace's, not the probes'
        if origin:
            for r in self.records.values():
                if r.id in earlier:
                    continue
                r.arrival -= origin
                r.first_token = None if r.first_token is None else r.first_token - origin
                r.finish = None if r.finish is None else r.finish - origin
        ends = [r.finish for r in self.records.values() if r.finish is not None]
        return SimResult(list(self.records.values()), max(ends) if ends else clock.t - origin, steps, stats,
                         time.perf_counter() - t0)


def simulate(trace, models: Iterable, calibration: Calibration = CPU_DEFAULT,
             engine_config: EngineConfig | None = None, devices: int = 1, fast_forward: bool = True) -> SimResult:
    """Run ``trace`` (objects with ``time``, ``model``, ``prompt_tokens``, ``output_tokens``, or
    4-tuples in that order) on ``models`` (preset names, ``SOURCE=ALIAS`` strings or ``ModelSpec``s)."""
    return Simulation(models, calibration, engine_config, devices, fast_forward).run(trace)
