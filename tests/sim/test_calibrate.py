"""The calibration fit recovers a known cost model; files without the newer terms still load."""

import pytest

from computron.bench.calibrate import _fit
from computron.sim.costs import H200_ROUGH, Calibration, batch_time


def test_fit_recovers_known_terms_and_never_goes_negative():
    true = (6e-4, 5e-13, 2e-6, 2.5e-15)  # fixed, per byte, per sequence, per sequence per byte
    rows = [(b, n, true[0] + true[1] * b + n * (true[2] + true[3] * b))
            for b in (2.5e8, 6.6e8, 2.6e9) for n in (1, 4, 16, 64)]
    got = _fit(rows)
    for g, t in zip(got, true):
        assert g == pytest.approx(t, rel=1e-6)
    flat = [(b, n, 5e-3) for b in (1e8, 1e9) for n in (32, 512)]  # no dependence at all: one fixed term
    got = _fit(flat)
    assert got[0] == pytest.approx(5e-3) and got[1:] == (0.0, 0.0, 0.0)
    evictions = [(b, 0, 3e-5 + b / 20e9) for b in (2.5e8, 6.6e8, 2.6e9)]  # a copy back at 20 GB/s
    got = _fit(evictions)
    assert got[0] == pytest.approx(3e-5, rel=1e-6) and got[1] == pytest.approx(1 / 20e9, rel=1e-6)
    noisy = [(b, n, t * (1.3 if n == 1 else 0.9)) for b, n, t in rows]
    assert min(_fit(noisy)) >= 0.0


def test_per_byte_fixed_terms_and_old_files():
    cal = Calibration(decode_fixed_s=1e-3, decode_fixed_s_per_byte=1e-12, decode_seq_s=0.0, decode_seq_s_per_byte=0.0,
                      hbm_bandwidth=1e15)
    assert batch_time(cal, 2 * 10**9, 0, 8) == pytest.approx(1e-3 + 2e-3)
    old = {k: v for k, v in H200_ROUGH.to_dict().items() if not k.endswith("fixed_s_per_byte")}
    assert Calibration.from_dict(old).decode_fixed_s_per_byte == 0.0


def test_bad_input_is_refused_with_its_reason(capsys):
    pytest.importorskip("torch")
    from computron.cli import main

    assert main(["bench", "calibrate", "no-such-model", "--device", "cpu", "--out", "/nonexistent/x.json"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["sim", "--models", "tiny-opt", "--rate", "1", "--sweep", "rate", "--values", "2,x"]) == 2
    assert "--values for --sweep rate: cannot read 'x' as a number" in capsys.readouterr().err
    assert main(["sim", "--models", "tiny-opt", "--rate", "1", "--sweep", "budget", "--values", "1GiB,lots"]) == 2
    assert "cannot read 'lots' as a size" in capsys.readouterr().err


def test_served_calibration_times_requests_through_the_http_server():
    pytest.importorskip("torch")
    pytest.importorskip("httpx")
    from computron.bench.calibrate import run

    res = run(["tiny-opt"], "cpu", batches=[1, 3], prompts=[8, 24], new=4, repeats=1, budget=None, serve=True)
    assert res["path"] == "served" and res["calibration"].name.endswith("(served)")
    pts = res["points"]
    assert [(m, p) for m, _, p, _ in pts["prefill"]] == [("tiny-opt", 8), ("tiny-opt", 24)]
    assert [(m, b) for m, _, b, _ in pts["decode"]] == [("tiny-opt", 1), ("tiny-opt", 3)]
    assert all(t > 0 for *_, t in pts["prefill"] + pts["decode"])
    assert len(pts["swap"]) == len(pts["evict"]) == 1  # swaps are timed on the engine, before the server starts


def test_legacy_calibration_times_the_first_swap_in_and_the_page_locked_allocation():
    """The legacy executor's first swap-in (pageable) and the evictions that allocate (its first two) are
    kept apart from the steady ones: one round more than --repeats, fitted into their own terms."""
    pytest.importorskip("torch")
    from computron.bench.calibrate import run

    res = run(["tiny-opt", "tiny-llama"], "cpu", batches=[1], prompts=[8], new=3, repeats=2, budget=None,
              executor="legacy")
    pts, cal = res["points"], res["calibration"]
    assert [m for m, *_ in pts["first_swap"]] == [m for m, *_ in pts["pin_evict"]] == ["tiny-opt", "tiny-llama"]
    assert len(pts["swap"]) == 2 * 3 and len(pts["evict"]) == 2 * 2  # swaps from page-locked copies; steady evictions
    assert cal.pageable_swap_bandwidth > 0 and cal.evict_pin_s_per_byte >= 0
    plain = run(["tiny-opt"], "cpu", batches=[1], prompts=[8], new=3, repeats=1, budget=None)
    assert "first_swap" not in plain["points"] and plain["calibration"].pageable_swap_bandwidth == 0.0


def test_the_cpus_a_run_may_use_count_a_containers_quota(tmp_path):
    import os

    from computron.bench.common import cpus_usable

    mine = len(os.sched_getaffinity(0))
    quota = tmp_path / "cpu.max"
    quota.write_text("max 100000\n")  # no quota: the affinity
    assert cpus_usable(str(quota)) == mine
    quota.write_text("50000 100000\n")  # half a CPU
    assert cpus_usable(str(quota)) == 0.5
    assert cpus_usable(str(tmp_path / "none")) == mine  # no cgroup v2 file


def test_shared_step_fraction_from_a_speed_up():
    from computron.bench.together import fraction_from_speedup

    assert fraction_from_speedup(2, 1.0) == 1.0  # nothing overlaps: each model's step costs in full
    assert fraction_from_speedup(2, 2.0) == 0.0  # the second costs nothing
    assert fraction_from_speedup(2, 1.28) == pytest.approx(0.5625)  # an H200's engine at batch 1
    assert fraction_from_speedup(6, 6 / (1 + 0.33 * 5)) == pytest.approx(0.33)  # the graphs' overlap
    assert fraction_from_speedup(3, 0.9) == 1.0 and fraction_from_speedup(3, 4.0) == 0.0  # clamped
    with pytest.raises(ValueError, match="at least 2 models, got 1"):
        fraction_from_speedup(1, 1.0)


def test_shared_steps_measured_through_two_engines_on_the_cpu():
    """Two copies of a model, one engine stepping one at a time and one both together: on the CPU
    nothing runs at once (steps together 0), yet the measurement runs end to end and each request
    makes its tokens."""
    pytest.importorskip("torch")
    from computron.bench.together import shared_step_fraction

    got = shared_step_fraction("tiny-opt", "cpu", k=2, batch=2, new=6, repeats=2)
    assert got["models"] == 2 and got["batch"] == 2 and got["steps_together"] == 0
    assert len(got["tokens_per_s_one_a_step"]) == len(got["tokens_per_s_together"]) == 2
    assert 0.0 <= got["fraction"] <= 1.0 and got["speedup"] > 0


def test_calibrating_on_the_cpu_keeps_the_shared_step_fraction_at_one(tmp_path):
    pytest.importorskip("torch")
    from computron.bench.calibrate import run

    res = run(["tiny-opt", "tiny-gpt2"], "cpu", [1, 2], [8, 16], 4, 1, None, shared_steps=2)
    assert res["shared_steps"] is None and res["calibration"].concurrent_step_fraction == 1.0


def test_the_shared_step_measurement_runs_in_a_process_of_its_own():
    """So that its engines' device memory is returned before the calibration's own engine takes its
    budget; the largest of the models is the one measured."""
    pytest.importorskip("torch")
    from computron.bench.calibrate import _shared_steps

    got = _shared_steps(["tiny-gpt2", "tiny-opt=small"], "cpu", 2, 1)  # tiny-opt: 512 bytes more
    assert got["model"] == "tiny-opt" and got["models"] == 2 and len(got["tokens_per_s_together"]) == 1


@pytest.mark.parametrize("value, why", [("1", "at least 2 models (0 skips it), got 1"),
                                        ("-3", "got -3"), ("two", "got 'two'")])
def test_shared_steps_must_be_zero_or_two_or_more(capsys, value, why):
    from computron.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "calibrate", "tiny-opt", "--device", "cpu", "--shared-steps", value])
    assert why in capsys.readouterr().err
