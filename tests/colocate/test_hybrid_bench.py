"""bench/hybrid.py runs every phase in one command on the CPU (tiny sizes): one row per phase with
its repeats, the start-up parts, handovers in the colocated modes, a JSON summary and a PNG."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_command_runs_every_phase_with_the_resnet_job(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "hybrid.py"), "--device", "cpu", "--job", "resnet",
           "--train-args", "--depth 14 --width 16 --image-size 32 --classes 10 --pool 16 --lr 0.01",
           "--global-batch", "8", "--micro-batch", "8", "--models", "2", "--model-gb", "0.002", "--capacity-gb", "0.02",
           "--static-train-gb", "0.012", "--idle", "0.3", "--rate", "4", "--cv", "2", "--duration", "1.5",
           "--repeats", "1", "--tokens", "2", "--warmup-steps", "1", "--tag", "t", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    out = json.loads((tmp_path / "hybrid_t.json").read_text())
    rows = {r["mode"]: r for r in out["rows"]}
    assert list(rows) == ["inference-alone", "training-alone", "normal", "static", "task-switch", "colocate"]
    assert all(r["repeats"] == 1 and r["failures"] == 0 for r in rows.values())
    assert set(out["startup"]) == {"host_images_s", "alone_job_warmup_s", "colocated_job_warmup_s"}
    for mode in ("normal", "static", "colocate"):
        assert rows[mode]["train_samples_per_s"] > 0 and "p99_s" in rows[mode], rows[mode]
    # task-switch pauses training whenever inference has work: over 1.5 s of bursts it may make no step
    assert rows["task-switch"]["train_samples_per_s"] >= 0 and "p99_s" in rows["task-switch"]
    for mode in ("task-switch", "colocate"):  # training held the memory inference asked for: handed over
        assert rows[mode]["handovers"] >= 1 and rows[mode]["handover_release_p99_ms"] >= 0
    assert (tmp_path / "hybrid_t.png").stat().st_size > 0


def test_the_release_bench_compares_bounds_against_unbounded(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "colocate_release.py"), "--device", "cpu", "--train-model", "tiny-opt",
           "--seq-len", "64", "--global-batch", "16", "--micro-batch", "8", "--capacity-gb", "0.0095",
           "--demand-gb", "0.003", "--run-ahead", "0,8", "--rounds", "1", "--window", "2", "--handovers", "3",
           "--warmup-steps", "1", "--tag", "t", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = json.loads((tmp_path / "colocate_release_t.json").read_text())["rows"]
    assert [r["run_ahead"] for r in rows] == [0, 8]
    for r in rows:  # every demand took memory from the job: each one a timed release
        assert r["handovers"] == 3 and r["samples_per_s"] > 0 and r["release_p99_ms"] >= r["release_p50_ms"] >= 0
    assert rows[0]["relative"] == 1.0
