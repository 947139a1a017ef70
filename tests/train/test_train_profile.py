"""Step profiles of a training job (``computron train --profile``, ``train/profile.py``): a window at a
given step and one asked for by another process through the request file, each written as a summary
whose figures come from the profiler (the host operators the step really ran), the request taken
once; bad settings refused with their reason; and ``bench/hybrid.py --profile-job`` profiling the job
in a run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from computron.train.config import TrainConfig
from computron.train.job import Trainer
from computron.train.profile import REQUEST, StepProfiler, union_s

ROOT = Path(__file__).resolve().parents[2]


def test_union_of_device_intervals():
    # microseconds: [0, 10] and [5, 20] overlap, [30, 31] apart, [12, 18] inside
    assert union_s([(5, 20), (0, 10), (30, 31), (12, 18)]) == pytest.approx(21e-6)
    assert union_s([]) == 0.0


def test_a_window_at_a_step_and_one_asked_for_by_a_file(tmp_path):
    out = tmp_path / "prof"
    cfg = TrainConfig(model="tiny-llama", seq_len=16, global_batch=4, micro_batch=2, steps=6, profile=str(out),
                      profile_at=2, profile_steps=2)
    tr = Trainer(cfg)
    asked = []

    def on_step(rec):
        if rec["step"] == 3:  # as bench/hybrid.py asks mid-run: one step, from the next one
            (out / REQUEST).write_text("1")
            asked.append(rec["step"])

    recs = tr.run(on_step)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6] and asked == [3]
    first = json.loads((out / "profile_0_0.json").read_text())
    second = json.loads((out / "profile_0_1.json").read_text())
    assert not (out / REQUEST).exists()  # taken once
    assert sorted(p.name for p in out.iterdir()) == ["profile_0_0.json", "profile_0_1.json"]
    assert (first["steps"], first["last_step"], second["steps"], second["last_step"]) == (2, 3, 1, 4)
    for d in (first, second):
        # two micro-batches a step: the projections' matrix products dominate the host's operators
        names = [h["name"] for h in d["top_host"]]
        assert "aten::mm" in names or "aten::addmm" in names, names
        assert d["wall_s"] > 0 and d["wall_s_per_step"] == pytest.approx(d["wall_s"] / d["steps"])
        assert d["end_unix"] - d["start_unix"] == pytest.approx(d["wall_s"], abs=1e-6)  # float seconds since 1970
        assert 0 < d["post_s"] < 60  # the profiler's own work after the window, timed
        assert d["device_busy_share"] is None and d["device_events"] == 0  # the CPU: no device timeline
        assert sum(h["self_s"] for h in d["top_host"]) <= d["host_self_s"] <= 2 * d["wall_s"]
    mm = {h["name"]: h["calls"] for h in first["top_host"]}
    one = {h["name"]: h["calls"] for h in second["top_host"]}
    assert mm["aten::mm"] == 2 * one["aten::mm"]  # two steps' operators against one step's


def test_a_request_that_is_not_a_number_profiles_the_default(tmp_path):
    logs = []
    prof = StepProfiler(tmp_path, steps=2, log=logs.append)
    (tmp_path / REQUEST).write_text("soon")
    assert prof._asked(1) == 2 and "not a number of steps" in logs[0]
    assert prof._asked(2) == 0  # taken


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="at least one step"):
        StepProfiler(tmp_path, steps=0)
    with pytest.raises(ValueError, match="counts steps from 1"):
        StepProfiler(tmp_path, at=0)


def test_hybrid_profiles_the_job_in_each_run(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "hybrid.py"), "--device", "cpu", "--train-model", "tiny-opt",
           "--seq-len", "16", "--global-batch", "4", "--micro-batch", "4", "--duration", "4", "--repeats", "1",
           "--warmup-steps", "1", "--job-timeout", "60", "--modes", "training-alone", "--profile-job", "2",
           "--tag", "p", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = json.loads((tmp_path / "hybrid_p_runs.json").read_text())["runs"]["training-alone"][0]
    prof = run["job_profile"]
    assert prof["steps"] == 2 and prof["inside_run"] and len(prof["top_host"]) == 5
    a, b = run["train_rate_left_out"]  # the rate's left-out span: the window and the profiler's work after it
    assert 0 < a < b < run["seconds"] and b - a == pytest.approx(prof["wall_s"] + prof["post_s"], abs=0.05)
    kept = [t for t in run["train_step_ends"] if not a <= t <= b]  # the rate: steps outside it over the time outside it
    assert kept and run["train_samples_per_s"] == pytest.approx(len(kept) * 4 / (run["seconds"] - (b - a)))
    row = json.loads((tmp_path / "hybrid_p.json").read_text())["rows"][0]
    assert row["job_step_ms"] == pytest.approx(1e3 * prof["wall_s_per_step"])
    assert row["job_host_ms_per_step"] == pytest.approx(1e3 * prof["host_self_s"] / 2)
    assert row["job_profile_left_out_s"] == pytest.approx(prof["wall_s"] + prof["post_s"])
    for flags, why in [(["--job", "resnet", "--profile-job", "2"], "--profile-job profiles computron train"),
                       (["--profile-job", "-1"], "--profile-job takes a number of steps, or 0 for none")]:
        bad = subprocess.run([*cmd[:2], *flags, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and why in bad.stderr, bad.stderr


def test_the_command_line_refuses_bad_profile_settings_before_building_anything(tmp_path, capsys):
    from computron.cli import main

    for flags, why in [(["--profile-steps", "0"], "--profile-steps: must be at least 1, got 0"),
                       (["--profile-at", "-2"], "--profile-at: must be at least 1, got -2")]:
        with pytest.raises(SystemExit) as e:
            main(["train", *flags])
        assert e.value.code == 2 and why in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["train", "--device", "cpu", "--profile", str(blocker / "profiles")]) == 2
    assert f"--profile {blocker / 'profiles'}: Not a directory" in capsys.readouterr().err


def test_the_training_rate_leaves_out_the_profiled_span():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from hybrid import Job
    finally:
        sys.path.remove(str(ROOT / "bench"))
    job = Job.__new__(Job)  # its step times only, no process
    job.steps = [float(t) for t in range(1, 11)]  # a step ending every second
    assert job.samples_per_s(0.0, 10.0, 4) == pytest.approx(4.0)
    # the window and the profiler's work after it: its 3 steps and 3 seconds left out
    assert job.samples_per_s(0.0, 10.0, 4, (3.5, 6.5)) == pytest.approx(7 * 4 / 7.0)
    # a span reaching past the run counts only its part inside
    assert job.samples_per_s(0.0, 10.0, 4, (8.5, 14.0)) == pytest.approx(8 * 4 / 8.5)


def test_bench_train_profile_on_two_ranks_writes_each_ranks_timeline(tmp_path):
    out, traces = tmp_path / "p.json", tmp_path / "traces"
    cmd = [sys.executable, str(ROOT / "bench" / "train_profile.py"), "--device", "cpu", "--config",
           "tiny-opt:2:8:64@pp=2", "--warmup", "1", "--trace", str(traces), "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ranks = json.loads(out.read_text())["runs"][0]["ranks"]
    assert len(ranks) == 2 and all(r["nccl_kernels"] == {} and r["compute_busy_s"] == 0.0 for r in ranks)  # gloo, no GPU
    names = sorted(f.name for f in traces.iterdir())
    assert names == [f"tiny-opt_mbs=2_gb=8_s=64_tp1_pp2_dp1_rank{r}.json.gz" for r in (0, 1)]
    import gzip
    for n in names:  # Chrome trace format: the step's host operators, the stage's send or receive among them
        ev = json.load(gzip.open(traces / n))["traceEvents"]
        assert any(e.get("name") in ("c10d::send", "c10d::recv_") for e in ev)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from train_profile import _family
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert [_family(n) for n in ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
                                 "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)")] == ["SendRecv", "AllReduce"]
