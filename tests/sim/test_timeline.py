"""Hand-computed timelines: the simulation reproduces the calibration's formulas exactly."""

import pytest

from computron.config import EngineConfig
from computron.models import PRESETS
from computron.sim import Calibration, Simulation, group_bytes, simulate

CAL = Calibration(name="test", swap_bandwidth=1e8, hbm_bandwidth=1e15, prefill_fixed_s=0.01, prefill_token_s=0.001,
                  prefill_token_s_per_byte=0.0, decode_fixed_s=0.002, decode_seq_s=0.0005,
                  decode_seq_s_per_byte=0.0, evict_s=0.003)
OPT, LLAMA = PRESETS["tiny-opt"], PRESETS["tiny-llama"]
W_OPT, W_LLAMA = sum(group_bytes(OPT)), sum(group_bytes(LLAMA))
ONE_MODEL = EngineConfig(gpu_memory_budget=1_000_000, workspace_bytes=0)  # holds one tiny model, not two
approx = lambda x: pytest.approx(x, rel=1e-12, abs=1e-15)  # noqa: E731


def cold_prefill_end(cfg, start, tokens):
    """By hand: group i's copy lands at start + (bytes of groups 0..i) / B; its compute (the prefill
    time split by bytes) starts once it has landed and the previous group's compute is done."""
    groups = group_bytes(cfg)
    total, compute = sum(groups), CAL.prefill_fixed_s + tokens * CAL.prefill_token_s
    t, landed = start, 0
    for g in groups:
        landed += g
        t = max(t, start + landed / 1e8) + compute * g / total
    return t


def warm(tokens, n):
    """Prefill of ``tokens`` on a resident model, then n-1 decode steps of batch 1."""
    return CAL.prefill_fixed_s + tokens * CAL.prefill_token_s + (n - 1) * (CAL.decode_fixed_s + CAL.decode_seq_s)


def test_one_request_cold():
    res = simulate([(1.0, "tiny-opt", 16, 5)], ["tiny-opt"], CAL)
    (r,) = res.records
    load = W_OPT / 1e8
    first = cold_prefill_end(OPT, 1.0, 16)
    # the load overlaps compute: after the load alone, before load + compute
    assert 1.0 + max(load, 0.026) < first < 1.0 + load + 0.026
    assert r.first_token == approx(first)
    assert r.finish == approx(first + 4 * (CAL.decode_fixed_s + CAL.decode_seq_s))
    assert r.finish_reason == "length" and res.steps == 5
    assert res.stats["swap_ins"] == 1 and res.stats["evictions"] == 0


def test_second_model_waits_for_an_eviction_and_its_load():
    res = simulate([(0.0, "tiny-opt", 16, 5), (0.0, "tiny-llama", 8, 3)], ["tiny-opt", "tiny-llama"], CAL, ONE_MODEL)
    a, b = res.records
    a_end = cold_prefill_end(OPT, 0.0, 16) + 4 * (CAL.decode_fixed_s + CAL.decode_seq_s)
    assert a.finish == approx(a_end)
    start_b = a_end + CAL.evict_s  # the eviction of tiny-opt, then tiny-llama's copies
    b_first = cold_prefill_end(LLAMA, start_b, 8)
    assert b.first_token == approx(b_first)
    assert b.finish == approx(b_first + 2 * (CAL.decode_fixed_s + CAL.decode_seq_s))
    assert res.stats["swap_ins"] == 2 and res.stats["evictions"] == 1


def test_prefetch_overlaps_the_next_load_with_compute():
    trace = [(0.0, "tiny-opt", 16, 5), (0.0, "tiny-llama", 8, 3)]
    on = simulate(trace, ["tiny-opt", "tiny-llama"], CAL, EngineConfig(prefetch=True))
    off = simulate(trace, ["tiny-opt", "tiny-llama"], CAL, EngineConfig(prefetch=False))
    a_end = cold_prefill_end(OPT, 0.0, 16) + 4 * (CAL.decode_fixed_s + CAL.decode_seq_s)
    # tiny-llama's copy follows tiny-opt's on the one link and lands long before tiny-opt is done
    assert (W_OPT + W_LLAMA) / 1e8 < a_end
    assert on.records[0].finish == approx(a_end) and off.records[0].finish == approx(a_end)
    assert on.records[1].finish == approx(a_end + warm(8, 3))
    b_first = cold_prefill_end(LLAMA, a_end, 8)
    assert off.records[1].finish == approx(b_first + 2 * (CAL.decode_fixed_s + CAL.decode_seq_s))
    assert on.records[1].latency < off.records[1].latency
    assert on.stats["evictions"] == off.stats["evictions"] == 0


def test_batched_decode_and_late_arrival():
    """Two requests of one model arriving together share prefill and decode steps; a third arrives
    while the model is idle and finds it warm."""
    trace = [(0.0, "tiny-opt", 4, 3), (0.0, "tiny-opt", 6, 2), (10.0, "tiny-opt", 5, 1)]
    res = simulate(trace, ["tiny-opt"], CAL)
    a, b, c = res.records
    first = cold_prefill_end(OPT, 0.0, 10)  # one batch: 4 + 6 prompt tokens
    two = CAL.decode_fixed_s + 2 * CAL.decode_seq_s
    assert a.first_token == b.first_token == approx(first)
    assert b.finish == approx(first + two)
    assert a.finish == approx(first + two + CAL.decode_fixed_s + CAL.decode_seq_s)
    assert c.first_token == c.finish == approx(10.0 + CAL.prefill_fixed_s + 5 * CAL.prefill_token_s)


def test_tuples_objects_and_summary():
    class A:
        def __init__(self, time, model, prompt_tokens, output_tokens):
            self.time, self.model, self.prompt_tokens, self.output_tokens = time, model, prompt_tokens, output_tokens

    res = simulate([A(0.5, "tiny-opt", 4, 2), (0.0, "tiny-llama", 4, 2)], ["tiny-opt", "tiny-llama"], CAL)
    s = res.summary()
    assert s["all"]["completed"] == 2 and set(s["models"]) == {"tiny-opt", "tiny-llama"}
    assert s["models"]["tiny-opt"]["latency"]["p50"] == pytest.approx(res.records[1].latency)
    assert res.records[0].model == "tiny-llama"  # ordered by arrival


def test_a_request_too_long_is_refused_not_fatal():
    res = simulate([(0.0, "tiny-opt", 600, 2), (0.0, "tiny-opt", 4, 2)], ["tiny-opt"], CAL)
    assert [r.finish_reason for r in res.records] == ["error", "length"]
    assert "context" in res.records[0].error


def test_executor_status_follows_the_clock():
    sim = Simulation(["tiny-opt"], CAL)
    sim.core.load("tiny-opt")
    st = sim.executor.status()
    assert st.models == {"tiny-opt": "loading"} and st.devices[0].weights == W_OPT
    assert sim.core.model_state("tiny-opt") == "loading"
    sim.core.load("tiny-opt", wait=True)
    assert sim.clock.now() == approx(W_OPT / 1e8)
    assert sim.executor.status().models == {"tiny-opt": "resident"}
    assert sim.core.model_state("tiny-opt") == "resident"
    sim.core.offload("tiny-opt")
    assert sim.executor.status().models == {} and sim.executor.status().devices[0].weights == 0


def test_the_computron_policy_loads_before_it_computes():
    """The legacy executor's swap-in waits for its whole load before returning: the first token
    comes after the full copy and then the whole prefill (no overlap of copy and compute)."""
    res = simulate([(1.0, "tiny-opt", 16, 5)], ["tiny-opt"], CAL, EngineConfig(policy="computron"))
    (r,) = res.records
    first = 1.0 + W_OPT / 1e8 + CAL.prefill_fixed_s + 16 * CAL.prefill_token_s
    assert r.first_token == approx(first) and first > cold_prefill_end(OPT, 1.0, 16)
    assert r.finish == approx(first + 4 * (CAL.decode_fixed_s + CAL.decode_seq_s))
