"""The simulation makes the same scheduling decisions as the real engine on the same trace.

The real ``Engine`` (CPU, tiny presets, a fake clock) is fed the same requests, each added before
the same scheduling step as in the simulation (arrival order, lengths and arrival stamps identical;
``max_tokens`` exactly the trace's output tokens, ``ignore_eos``). Every ``StepPlan`` of both
cores is recorded by wrapping ``Scheduler.schedule`` and compared step by step.
"""

import pytest

pytest.importorskip("torch")

from computron.config import EngineConfig  # noqa: E402
from computron.engine import Engine, SamplingParams  # noqa: E402
from computron.sim import Simulation  # noqa: E402

MODELS = ["tiny-opt", "tiny-llama", "tiny-gpt2"]
# (time, model, prompt tokens, output tokens): bursts and gaps, so models swap, prefetch and batch
TRACE = [(0.0, "tiny-opt", 20, 6), (0.0, "tiny-llama", 9, 4), (0.001, "tiny-opt", 33, 3),
         (0.002, "tiny-gpt2", 5, 7), (0.004, "tiny-llama", 17, 5), (0.02, "tiny-gpt2", 40, 2),
         (0.02, "tiny-opt", 3, 9), (0.021, "tiny-opt", 12, 4), (0.05, "tiny-llama", 30, 3),
         (0.05, "tiny-gpt2", 8, 6), (0.0501, "tiny-opt", 16, 17), (0.2, "tiny-llama", 2, 2),
         (0.2, "tiny-gpt2", 11, 5), (0.2, "tiny-opt", 7, 3)]

CONFIGS = {
    "holds-one": dict(gpu_memory_budget=1_000_000, workspace_bytes=0),
    "holds-two": dict(gpu_memory_budget=1_500_000, workspace_bytes=0, max_batch_size=2),
    "holds-all-no-prefetch": dict(gpu_memory_budget=4_000_000, workspace_bytes=0, prefetch=False),
    "kv-tight": dict(gpu_memory_budget=760_000, workspace_bytes=0, max_tokens_per_step=40),
    "two-models-a-step": dict(gpu_memory_budget=1_500_000, workspace_bytes=0, models_per_step=2),
}
# kv-tight: five blocks of tiny-opt's KV cache beside its weights; four requests of one block each
# all need a second block at once, so the newest are preempted and recompute later
TRACES = {"kv-tight": [(0.0, "tiny-opt", 15, 20)] * 4 + [(0.001, "tiny-llama", 9, 4), (0.002, "tiny-opt", 30, 2)]}


def _record(stepper) -> list:
    """Every plan the scheduler makes, from the step of ``stepper`` (the simulation's or the engine's:
    each core step plans once and returns that plan), one entry per step it runs."""
    plans = []
    inner = stepper.step

    def step(*args):
        p = inner(*args)
        plans.append((tuple(p.evictions), tuple(p.loads), tuple(p.prefetch),
                      tuple((b.model, tuple(b.prefill), tuple(b.decode)) for b in p.batches),
                      tuple(p.preempted), tuple(rid for rid, _ in p.failed)))
        # a run: its later steps decode the whole batch, the requests it admitted after those running,
        # less those that made their last token in an earlier step of it (``p.ends``)
        ends = p.ends or {}
        for k in range(1, p.steps):
            plans.append(((), (), (), tuple((b.model, (), tuple(r for r in tuple(b.decode) + tuple(b.prefill)
                                                                if ends.get(r, p.steps) > k)) for b in p.batches),
                          (), ()))
        return p

    stepper.step = step
    return plans


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_plans_as_the_real_engine(name):
    cfg = dict(device="cpu", cuda_graphs=False, **CONFIGS[name])
    sim = Simulation(MODELS, engine_config=EngineConfig(**cfg))
    sim_plans = _record(sim)
    res = sim.run(TRACES.get(name, TRACE))
    assert all(r.finish_reason == "length" for r in res.records), [(r.id, r.error) for r in res.records]

    now = [0.0]
    eng = Engine(EngineConfig(**cfg), clock=lambda: now[0])
    for m in MODELS:
        eng.register_model(m)
    assert eng.executor.status().devices[0].capacity == sim.executor.status().devices[0].capacity
    real_plans = _record(eng)
    pending = sorted(res.records, key=lambda r: (r.step, r.arrival, int(r.id[1:])))
    reqs, i = {}, 0
    while True:
        while i < len(pending) and pending[i].step <= len(real_plans):
            r = pending[i]
            assert r.step == len(real_plans)
            now[0] = r.arrival
            reqs[r.id] = eng.submit(r.model, [3] * r.prompt_tokens,
                                    SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True),
                                    request_id=r.id)
            i += 1
        if not eng.has_work():
            if i >= len(pending):
                break
            continue
        eng.step()
        assert len(real_plans) <= len(sim_plans) + 1
    assert len(real_plans) == len(sim_plans)
    for k, (a, b) in enumerate(zip(real_plans, sim_plans)):
        assert a == b, f"step {k}: engine {a} != simulation {b}"
    assert all(len(q.output_ids) == q.params.max_tokens and q.finish_reason == "length" for q in reqs.values())
    for key in ("swap_ins", "evictions", "steps", "preemptions"):
        assert eng.stats[key] == res.stats[key], key
    if name == "holds-one":
        assert res.stats["evictions"] > 0
    if name == "kv-tight":
        assert res.stats["preemptions"] > 0
    if name == "holds-two":
        assert any(p[2] for p in sim_plans)  # prefetched
    if name == "two-models-a-step":
        assert any(len(p[3]) == 2 for p in sim_plans)  # steps that ran two models' batches
