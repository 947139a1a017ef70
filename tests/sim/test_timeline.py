"""Hand-computed timelines: the simulation reproduces the calibration's formulas exactly."""

from dataclasses import replace

import pytest

from computron.config import EngineConfig
from computron.models import PRESETS
from computron.sim import Calibration, Simulation, arena_capacity, group_bytes, simulate

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


# The legacy executor's copies (computron policy): pageable host memory until a model's first eviction,
# then page-locked copies that each eviction allocates anew unless an earlier eviction freed one.
LEGACY = replace(CAL, evict_s_per_byte=1e-9, evict_pin_s_per_byte=2e-8, pageable_swap_bandwidth=5e7)
PREFILL16 = CAL.prefill_fixed_s + 16 * CAL.prefill_token_s


def test_legacy_evictions_pay_for_page_locked_copies_until_a_freed_one_is_reused():
    """Two models of one shape, one resident at a time, requests 10 s apart. By hand, with W bytes each:
    the first load of each reads pageable memory (W / 5e7), later ones page-locked (W / 1e8); every
    eviction copies back (evict_s + W * 1e-9), and the first three allocate (W * 2e-8): a's (no copy
    freed yet), b's (a's pageable copy is not cached), a's second (b's and a's copies both held); that
    one frees a's first copy, which b's second eviction reuses."""
    trace = [(10.0 * i, "ab"[i % 2], 16, 1) for i in range(5)]
    sim = Simulation(["tiny-opt=a", "tiny-opt=b"], LEGACY, EngineConfig(policy="computron", max_loaded=1))
    res = sim.run(trace)
    evict, pin = LEGACY.evict_s + W_OPT * 1e-9, W_OPT * 2e-8
    expect = [W_OPT / 5e7,  # a: pageable, nothing to evict
              evict + pin + W_OPT / 5e7,  # a's first eviction allocates; b is still pageable
              evict + pin + W_OPT / 1e8,  # b's first eviction allocates; a's copy is page-locked
              evict + pin + W_OPT / 1e8,  # a's second: both copies are held, so it allocates, then frees one
              evict + W_OPT / 1e8]  # b's second reuses the freed copy
    for i, (r, e) in enumerate(zip(res.records, expect)):
        assert r.first_token == r.finish == approx(10.0 * i + e + PREFILL16)
    assert sim.executor.stats["pinned_bytes"] == 3 * W_OPT and sim.executor.stats["pin_s"] == approx(3 * pin)
    assert res.stats["swap_ins"] == 5 and res.stats["evictions"] == 4
    # the default executor's images are page-locked from the start and its evictions allocate nothing
    res = simulate(trace, ["tiny-opt=a", "tiny-opt=b"], LEGACY, ONE_MODEL)
    for i, r in enumerate(res.records):
        assert r.first_token == approx(cold_prefill_end(OPT, 10.0 * i + (evict if i else 0.0), 16))


def test_legacy_weights_live_outside_the_arena():
    """The legacy executor keeps device weights in PyTorch's allocator: two models whose weights do not
    fit the arena together are resident at once, and one request's cache may take the whole arena."""
    cfg = EngineConfig(policy="computron", max_loaded=2, gpu_memory_budget=1_000_000, workspace_bytes=0)
    assert W_OPT + W_LLAMA > arena_capacity(1_000_000, 0) and W_OPT + 32 * 16 * 1024 > arena_capacity(1_000_000, 0)
    sim = Simulation(["tiny-opt", "tiny-llama"], LEGACY, cfg)
    res = sim.run([(0.0, "tiny-opt", 480, 20), (0.0, "tiny-llama", 8, 3)])  # 500 tokens: 32 blocks of 16 KiB
    assert [r.finish_reason for r in res.records] == ["length", "length"]
    assert res.stats["swap_ins"] == 2 and res.stats["evictions"] == 0
    st = sim.executor.status()
    assert st.devices[0].weights == W_OPT + W_LLAMA and set(st.models) == {"tiny-opt", "tiny-llama"}


def test_legacy_decode_captures_no_graphs():
    """A calibration with a graph-capture cost charges nothing under the legacy executor (eager decode)."""
    cal = replace(CAL, graph_capture_s=0.5)
    res = simulate([(1.0, "tiny-opt", 16, 5)], ["tiny-opt"], cal, EngineConfig(policy="computron"))
    first = 1.0 + W_OPT / 1e8 + PREFILL16
    assert res.records[0].finish == approx(first + 4 * (CAL.decode_fixed_s + CAL.decode_seq_s))


def test_probes_first_start_the_trace_as_loadgen_leaves_the_server():
    """loadgen's probes (a warm-up and a solo request per model, in name order) leave b and c resident and a's
    host copy page-locked; the trace's times are relative to their end and its counters leave them out.
    By hand: b and c are warm (a prefill each, one step after the other); a, 5 s later, evicts b (the least
    recently used; its first eviction, so it allocates) and loads from its page-locked copy."""
    trace = [(0.0, "b", 16, 1), (0.0, "c", 16, 1), (5.0, "a", 16, 1)]
    sim = Simulation(["tiny-opt=a", "tiny-opt=b", "tiny-opt=c"], LEGACY, EngineConfig(policy="computron", max_loaded=2))
    solo = sim.probe(trace)
    assert solo == {"a": approx(PREFILL16), "b": approx(PREFILL16), "c": approx(PREFILL16)}  # warm after the warm-up
    assert sim.origin > 0 and set(sim.executor.status().models) == {"b", "c"}
    res = sim.run(trace)
    b, c, a = res.records
    assert b.first_token == approx(PREFILL16) and c.first_token == approx(2 * PREFILL16)
    assert a.first_token == approx(5.0 + LEGACY.evict_s + W_OPT * 1e-9 + W_OPT * 2e-8 + W_OPT / 1e8 + PREFILL16)
    assert a.arrival == approx(5.0) and res.end_time == approx(a.finish)
    assert res.stats["swap_ins"] == 1 and res.stats["evictions"] == 1


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_batches_sharing_a_device_take_the_longest_plus_a_fraction_of_the_others(fraction):
    """Two resident models decode in one step (models_per_step 2): the step lasts the longer batch
    plus ``concurrent_step_fraction`` of the other (1: one after the other), both end with it."""
    cal = replace(CAL, concurrent_step_fraction=fraction)
    both = EngineConfig(gpu_memory_budget=64 * 2**20, workspace_bytes=0, models_per_step=2)
    trace = [(0.0, "tiny-opt", 16, 4), (0.0, "tiny-opt", 16, 4), (0.0, "tiny-llama", 8, 4)]
    sim = Simulation(["tiny-opt", "tiny-llama"], cal, both)
    sim.probe([(0.0, "tiny-opt", 1, 1), (0.0, "tiny-llama", 1, 1)])  # both resident and warm
    start, probe_busy = sim.clock.t, sim.executor.stats["compute_s"]
    res = sim.run([(start + t, m, p, o) for t, m, p, o in trace])
    a, b, c = res.records
    prefill = cal.prefill_fixed_s + 32 * cal.prefill_token_s, cal.prefill_fixed_s + 8 * cal.prefill_token_s
    decode = cal.decode_fixed_s + 2 * cal.decode_seq_s, cal.decode_fixed_s + cal.decode_seq_s
    first = max(prefill) + fraction * min(prefill)
    assert a.first_token == b.first_token == c.first_token == approx(start + first)
    step = max(decode) + fraction * min(decode)
    assert a.finish == b.finish == c.finish == approx(start + first + 3 * step)
    busy = sim.executor.stats["compute_s"]
    assert busy - probe_busy == approx(first + 3 * step)  # the device's compute, shared steps counted once


def test_together_never_beats_reading_every_weight():
    cal = replace(CAL, concurrent_step_fraction=0.0, hbm_bandwidth=1e9)
    assert cal.together([0.002, 0.001], 1_000_000) == approx(0.002)
    assert cal.together([0.002, 0.001], 3_000_000) == approx(0.003)  # 3 MB at 1 GB/s
    with pytest.raises(ValueError, match="concurrent_step_fraction must be at most 1, got 1.5"):
        replace(CAL, concurrent_step_fraction=1.5)


def test_a_models_first_capture_of_a_bucket_adds_its_warm_up_once():
    """Graphs cost ``graph_capture_s`` after every load, and a model's first capture of a bucket adds
    ``graph_warmup_s`` (its kernels compiled and tuned): a second load captures again without it."""
    cal = replace(CAL, graph_capture_s=0.004, graph_warmup_s=0.05)
    cfg = replace(ONE_MODEL, cuda_graphs=True, max_batch_size=4)
    trace = [(0.0, "tiny-opt", 16, 3), (1.0, "tiny-llama", 8, 2), (2.0, "tiny-opt", 16, 3)]
    sim = Simulation(["tiny-opt", "tiny-llama"], cal, cfg)
    a, _, c = sim.run(trace).records
    step = CAL.decode_fixed_s + CAL.decode_seq_s
    assert a.finish - a.first_token == approx(2 * step + 0.004 + 0.05)  # first capture of bucket 1
    assert c.finish - c.first_token == approx(2 * step + 0.004)  # after its reload: captured again only
    assert sim.executor.stats["graph_captures"] == 3
