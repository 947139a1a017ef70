"""Fast-forward (steady decode batches run several steps per core call) changes nothing a user sees:
every request's first-token and finish times, and the core's counters, equal those of single steps."""

import dataclasses
import random

import pytest

from computron.config import EngineConfig
from computron.sim import Simulation
from computron.sim.costs import H200_ROUGH


def _trace(seed: int, n: int, models: list[str]) -> list[tuple]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(40.0) if rng.random() < 0.8 else rng.uniform(0.2, 1.0)  # bursts and gaps
        out.append((t, rng.choice(models), rng.randint(1, 700), rng.randint(1, 300)))
    return out


# decode graphs captured again after every load (a GPU's executor): a run's first step pays one
CAPTURING = dataclasses.replace(H200_ROUGH, graph_capture_s=0.02, graph_capture_s_per_byte=1e-12, graph_warmup_s=0.03)


@pytest.mark.parametrize("seed,budget,batch,cal", [(0, "8GiB", 256, H200_ROUGH), (1, "6GiB", 8, H200_ROUGH),
                                                   (2, "3.2GiB", 64, H200_ROUGH), (3, "6GiB", 64, CAPTURING)])
def test_same_outcome_as_single_steps(seed, budget, batch, cal):
    models = ["opt-1.3b=a", "opt-1.3b=b", "opt-350m=c"]
    trace = _trace(seed, 300, ["a", "b", "c"])
    cfg = EngineConfig(device="cpu", gpu_memory_budget=budget, max_batch_size=batch)
    slow_sim = Simulation(models, cal, cfg, fast_forward=False)
    slow = slow_sim.run(trace)
    fast_sim = Simulation(models, cal, cfg)
    calls, spans, through = [], [], []
    inner = fast_sim.step

    def step(k=1):
        t0 = fast_sim.clock.t
        plan = inner(k)
        calls.append(plan.steps)
        if plan.ends:
            through.append(len(plan.ends))  # a run that went on past some of its requests' last tokens
        if any(t0 < t < fast_sim.clock.t for t, *_ in trace):
            spans.append(plan.steps)  # requests arrived during this run: they queued behind others
        return plan

    fast_sim.step = step
    fast = fast_sim.run(trace)
    assert [(r.id, r.finish_reason, r.error) for r in fast.records] == \
           [(r.id, r.finish_reason, r.error) for r in slow.records]
    for a, b in zip(fast.records, slow.records):
        assert a.first_token == pytest.approx(b.first_token, rel=1e-12, abs=1e-12), a.id
        assert a.finish == pytest.approx(b.finish, rel=1e-12, abs=1e-12), a.id
    assert fast.stats == slow.stats and fast.steps == slow.steps
    assert max(calls) > 50 and len(calls) < slow.steps / 3  # it really ran long steps
    assert max(spans) > 1
    if budget == "3.2GiB":
        assert slow.stats["preemptions"] > 0 and slow.stats["evictions"] > 0
    if cal is CAPTURING:  # a smaller batch may capture a graph: its steps are not shorter, runs stop at ends
        assert not fast_sim.executor.end_runs and not through
    else:
        assert fast_sim.executor.end_runs and len(through) > 5 and max(through) > 1
    if cal is CAPTURING:  # captured again after loads, at several batch sizes
        captures = slow_sim.executor.stats["graph_captures"]
        assert captures == fast_sim.executor.stats["graph_captures"] and captures > slow.stats["swap_ins"] > 3


@pytest.mark.parametrize("limit", [30, 90, 150])
def test_a_run_cut_at_max_steps_stops_there_even_through_ends(limit):
    """``run(trace, max_steps=N)`` stops after exactly N steps, runs that go on past requests' ends
    included (the cap of each stretch counts the steps made before it), with what single steps would
    have by then. One model's twenty requests at once: nothing arrives to bound the runs, only the cap."""
    rng = random.Random(0)
    trace = [(0.0, "a", rng.randint(1, 50), rng.randint(5, 200)) for _ in range(20)]
    cfg = EngineConfig(device="cpu", gpu_memory_budget="8GiB", max_batch_size=256)
    slow = Simulation(["opt-1.3b=a"], H200_ROUGH, cfg, fast_forward=False).run(trace, max_steps=limit)
    sim = Simulation(["opt-1.3b=a"], H200_ROUGH, cfg)
    ends, inner = [], sim.step

    def step(k=1):
        plan = inner(k)
        ends.append(len(plan.ends or ()))
        return plan

    sim.step = step
    fast = sim.run(trace, max_steps=limit)
    assert slow.steps == fast.steps == limit and sum(ends) > 0
    assert [(r.id, r.finish_reason) for r in fast.records] == [(r.id, r.finish_reason) for r in slow.records]
    for a, b in zip(fast.records, slow.records):
        assert (a.finish is None) == (b.finish is None), a.id
        if a.finish is not None:
            assert a.finish == pytest.approx(b.finish, rel=1e-12, abs=1e-12), a.id
