"""SimExecutor's answers to the executor protocol (load reports, the clock, errors in the future), and
the run loop's hold on the garbage collector."""

import dataclasses
import gc

import pytest

from computron.config import EngineConfig
from computron.messages import ExecuteBatch, ModelDescription, Residency, SamplingParams, SeqInput
from computron.models import PRESETS
from computron.sim import Calibration, SimExecutor, Simulation, group_bytes, simulate

CAL = Calibration(name="test", swap_bandwidth=1e7, hbm_bandwidth=1e15, prefill_fixed_s=0.01, prefill_token_s=0.001,
                  prefill_token_s_per_byte=0.0, decode_fixed_s=0.002, decode_seq_s=0.0005,
                  decode_seq_s_per_byte=0.0, evict_s=0.003)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def executor():
    ex = SimExecutor(EngineConfig(gpu_memory_budget=4_000_000, workspace_bytes=0), CAL)
    for name in ("a", "b"):
        ex.register(ModelDescription(name, "tiny-opt"))
    return ex


def test_each_load_is_reported_once_when_it_has_landed():
    ex, load = executor(), sum(group_bytes(PRESETS["tiny-opt"])) / 1e7
    ex.apply(Residency(load=["a", "b"]))  # one copy stream: b lands after a
    # a's batch computes as a's groups land; the step ends before b's copies do
    step = ex.execute([ExecuteBatch("a", [SeqInput("r", [1] * 8, 0, GREEDY)])]).result()
    assert step.loaded == {"a": pytest.approx(load)} and ex.clock.t < 2 * load
    assert ex.status().models == {"a": "resident", "b": "loading"}
    assert ex.wait_loads() == {"b": pytest.approx(load)} and ex.clock.t == pytest.approx(2 * load)
    assert ex.wait_loads() == {}  # reported once
    step = ex.execute([ExecuteBatch("a", [SeqInput("r", [1], 8, GREEDY)])]).result()
    assert step.loaded == {} and step.tokens == {"r": ex.models["a"].token}


def test_a_batch_of_a_model_not_on_its_device_fails_in_the_future():
    ex = executor()
    fut = ex.execute([ExecuteBatch("b", [SeqInput("r", [1] * 8, 0, GREEDY)])])
    assert fut.done()
    with pytest.raises(RuntimeError, match="model 'b' runs a batch but is not on its device"):
        fut.result()
    assert isinstance(fut.exception(), RuntimeError)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_run_gives_the_collector_back_as_it_found_it(enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        res = simulate([(0.0, "tiny-opt", 8, 3)], ["tiny-opt"], CAL)
        assert res.records[0].finish_reason == "length"
        assert gc.isenabled() == enabled
        sim = Simulation(["tiny-opt"], CAL)

        def broken(max_steps=1):
            raise RuntimeError("broken step")

        sim.step = broken
        with pytest.raises(RuntimeError, match="broken step"):  # a run that fails gives it back too
            sim.run([(0.0, "tiny-opt", 8, 3)])
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("host, links", [(0.0, 4e7), (2.5e7, 2.5e7)])
def test_a_striped_load_pulls_through_every_link_up_to_the_host_side(host, links):
    # three helpers' links beside the model's own (1e7 bytes/s each), capped by the host side when given;
    # the slo policy's cost of the load is the same
    from dataclasses import replace

    from computron.scheduler.slo import ModelCost

    cal = replace(CAL, host_bandwidth=host)
    ex = SimExecutor(EngineConfig(gpu_memory_budget=4_000_000, workspace_bytes=0, stripe_devices=[1, 2, 3]), cal)
    info = ex.register(ModelDescription("a", "tiny-opt"))
    nbytes = sum(group_bytes(PRESETS["tiny-opt"]))
    ex.apply(Residency(load=["a"]))
    assert ex.wait_loads() == {"a": pytest.approx(nbytes / links)}
    assert cal.load_time(nbytes, 0, False, (1, 2, 3)) == pytest.approx(nbytes / links)
    cost = ModelCost.from_calibration(cal, info.weight_bytes, info.placement.devices, ex.stripe)
    assert cost.load_s == pytest.approx(nbytes / links)
    # the legacy executor does not stripe, and says so, as the engine's does
    with pytest.raises(ValueError, match="the legacy executor .* copies through one link"):
        SimExecutor(EngineConfig(gpu_memory_budget=4_000_000, workspace_bytes=0, stripe_devices=[1, 2, 3],
                                 executor="legacy"), cal)


def test_under_workers_a_load_pulls_through_the_links_its_plan_lends():
    # the worker executor's striping: the scheduler lends links load by load (Residency.stripes); a load it
    # lends none goes over the model's own link alone (1e7 bytes/s a link, no host-side cap)
    ex = SimExecutor(EngineConfig(gpu_memory_budget=4_000_000, workspace_bytes=0, stripe_devices=[1, 2, 3],
                                  executor="workers"), CAL)
    ex.register(ModelDescription("a", "tiny-opt"))
    nbytes = sum(group_bytes(PRESETS["tiny-opt"]))
    ex.apply(Residency(load=["a"]))
    assert ex.wait_loads() == {"a": pytest.approx(nbytes / 1e7)}
    ex.apply(Residency(evict=["a"]))
    ex.apply(Residency(load=["a"], stripes={"a": (1, 2)}))
    assert ex.wait_loads() == {"a": pytest.approx(nbytes / 3e7)}


def test_a_decode_step_costs_what_batch_time_says_computed_once_per_batch_size():
    """The executor keeps each model's decode-step seconds per batch size: the same float as
    ``batch_time``, for a step of one and a run of several, and for ``steps_before``."""
    from computron.sim.costs import batch_time

    ex = executor()
    ex.apply(Residency(load=["a"]))
    ex.wait_loads()
    m = ex.models["a"]
    for batch in (1, 3, 1):
        seqs = [SeqInput(f"r{batch}-{i}", [1], 8, GREEDY) for i in range(batch)]
        t0 = ex.clock.t
        step = ex.execute([ExecuteBatch("a", seqs, steps=4)]).result()
        end = t0 + 4 * batch_time(CAL, m.nbytes, 0, batch)
        assert ex.clock.t == end and step.compute_s == {"a": end - t0}
        ex.free([s.req_id for s in seqs])
    assert m.decode_s == {1: batch_time(CAL, m.nbytes, 0, 1), 3: batch_time(CAL, m.nbytes, 0, 3)}
    dt = batch_time(CAL, m.nbytes, 0, 2)
    assert ex.steps_before("a", 2, ex.clock.t + 2.5 * dt, 100) == 3 and m.decode_s[2] == dt


def test_a_run_that_starts_with_prefills_times_its_first_step_apart():
    """A batch of k steps whose first prefills a prompt beside a decode: the first step costs the
    mixed ``batch_time``, its new request's first token comes at its end (``first_at``), the k - 1
    after it decode both; ``steps_before`` counts such a run as single steps would."""
    from computron.sim.costs import batch_time

    ex = executor()
    ex.apply(Residency(load=["a"]))
    ex.wait_loads()
    m = ex.models["a"]
    first = batch_time(CAL, m.nbytes, 12, 1, 1)  # 12 prompt tokens and one decode
    dt = batch_time(CAL, m.nbytes, 0, 2)
    t0 = ex.clock.t
    assert ex.steps_before("a", 2, t0 + first / 2, 100, (12, 1)) == 1  # the first step ends past it
    assert ex.steps_before("a", 2, t0 + first + 2.5 * dt, 100, (12, 1)) == 4
    assert ex.steps_before("a", 2, t0 + first + 2.5 * dt, 100) > 4  # as decode steps alone: more fit
    seqs = [SeqInput("old", [1], 8, GREEDY), SeqInput("new", [3] * 12, 0, GREEDY)]
    out = ex.execute([ExecuteBatch("a", seqs, steps=4)]).result()
    assert out.first_at == {"a": t0 + first}
    assert ex.clock.t == pytest.approx(t0 + first + 3 * dt, rel=1e-12)
    assert out.tokens == {"old": [m.token] * 4, "new": [m.token] * 4}
    assert ex.seqs["new"].blocks == (12 + 3 + ex.block_tokens - 1) // ex.block_tokens  # its prompt and 3 tokens
    one = ex.execute([ExecuteBatch("a", [SeqInput("x", [3] * 12, 0, GREEDY)])]).result()
    assert one.first_at is None  # a single step's tokens come at its end


def test_a_run_whose_sequences_end_early_times_each_stretch_as_separate_runs_would():
    """``lasts``: of three sequences decoding 6 steps, one ends after 2 and one after 4. Each stretch
    costs the steps of the batch left, added up as three runs one after another would be (the same
    floats); each ending sequence gets its tokens and its stretch's end (``ended_at``); ``steps_before``
    after those stretches counts from there. A cold model's run may not shrink."""
    from computron.sim.costs import batch_time

    ex = executor()
    assert ex.end_runs  # no decode graphs to capture: a smaller batch never takes longer
    ex.apply(Residency(load=["a"]))
    ex.wait_loads()
    m = ex.models["a"]
    t0 = ex.clock.t
    seqs = [SeqInput(r, [1], 8, GREEDY) for r in ("x", "y", "z")]
    out = ex.execute([ExecuteBatch("a", seqs, steps=6, lasts={"x": 2, "y": 4})]).result()
    t1 = t0 + batch_time(CAL, m.nbytes, 0, 3) * 2
    t2 = t1 + batch_time(CAL, m.nbytes, 0, 2) * 2
    t3 = t2 + batch_time(CAL, m.nbytes, 0, 1) * 2
    assert out.ended_at == {"x": t1, "y": t2} and ex.clock.t == t3
    assert out.tokens == {"x": [m.token] * 2, "y": [m.token] * 4, "z": [m.token] * 6}
    assert ex.after_stretches("a", [(2, 3), (2, 2), (2, 1)]) == pytest.approx(t3 + (t3 - t0), rel=1e-12)  # from now
    for lasts, why in (({"z": 7}, "runs 1 to 6 steps"), ({"z": 0}, "runs 1 to 6 steps"), ({"q": 2}, "of the batch")):
        with pytest.raises(ValueError, match=why):
            ex.execute([ExecuteBatch("a", [SeqInput("z", [1], 14, GREEDY)], steps=6, lasts=lasts)]).result()
    ex.apply(Residency(load=["b"]))  # copies in flight: its first run is cold
    with pytest.raises(ValueError, match="whose sequences end early: they must decode a warm batch"):
        ex.execute([ExecuteBatch("b", [SeqInput("w", [1], 8, GREEDY)], steps=3, lasts={"w": 1})]).result()
    capturing = SimExecutor(EngineConfig(gpu_memory_budget=4_000_000, workspace_bytes=0),
                            dataclasses.replace(CAL, graph_capture_s=0.01))
    capturing.register(ModelDescription("a", "tiny-opt"))
    capturing.apply(Residency(load=["a"]))
    capturing.wait_loads()
    assert not capturing.end_runs and not capturing.status().end_runs
    with pytest.raises(ValueError, match="does not run them"):
        capturing.execute([ExecuteBatch("a", [SeqInput("w", [1], 8, GREEDY)], steps=3, lasts={"w": 1})]).result()
