"""`computron bench hybrid` (and bench/hybrid.py, which runs it) runs every phase in one command on the
CPU with the real engine (tiny sizes): one `computron serve --colocate` process whose mode the bench
switches, a `computron train` job alone and one colocated, one trace replayed per phase; one row per phase, the start-up parts, the
handovers split into their parts, a JSON summary and a PNG."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODES = ("normal", "static", "task-switch", "colocate")


def test_one_command_runs_every_phase_against_the_real_server(tmp_path):
    # tiny-opt job: 5.1 MB at its full micro-batch of 8, 3.7 MB at 1; the arbiter shares 5.4 MB, so two
    # served tiny-opt copies (0.67 MB each, and their caches) make the job shrink, not pause
    cmd = [sys.executable, "-m", "computron.cli", "bench", "hybrid", "--device", "cpu", "--preset", "tiny-opt",
           "--models", "2", "--train-model", "tiny-opt", "--seq-len", "16", "--global-batch", "8",
           "--micro-batch", "8", "--capacity-gb", "0.005", "--workspace-gb", "0.0001", "--static-train-gb", "0.0037",
           "--idle", "0.3", "--rate", "8", "--cv", "2", "--duration", "2", "--prompt", "8", "--output", "4",
           "--repeats", "1", "--warmup-steps", "1", "--job-timeout", "60", "--tag", "t", "--out", str(tmp_path),
           "--modes", "inference-alone,training-alone,normal,static,task-switch,colocate,colocate+yield,"
                      "colocate+yield-first,static@0.004"]  # the defaults, and static at a second split
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads((tmp_path / "hybrid_t.json").read_text())
    rows = {r["mode"]: r for r in out["rows"]}
    assert list(rows) == ["inference-alone", "training-alone", "normal", "static", "task-switch", "colocate",
                          "colocate+yield", "colocate+yield-first", "static@0.004"]
    assert set(out["startup"]) == {"alone_job_warmup_s", "serve_ready_s", "serve_warmup_s",
                                   "colocated_job_warmup_s", "mode_switch_p50_s"}
    assert set(out["solo_latency_by_model_s"]) == {"a", "b"}  # the trace asks both served copies
    runs = json.loads((tmp_path / "hybrid_t_runs.json").read_text())["runs"]
    n = out["requests"]
    per_swap = set()
    for mode, row in rows.items():  # every request of the trace answered, in every phase with inference
        assert row["repeats"] == 1 and row["failures"] == 0, (mode, row)
        if mode != "training-alone":
            reqs = runs[mode][0]["requests"]
            assert len(reqs) == n and all(q["tokens"] == 4 and q["error"] is None for q in reqs), (mode, reqs)
            # the server's swap-ins during this run: each run starts with both copies off the device
            sw = runs[mode][0]["server_swaps"]
            assert sw["computron_model_swaps_total"] >= 2, (mode, sw)
            assert sw["computron_graph_captures_total"] == 0  # read too (the CPU captures no decode graphs)
            per_swap.add(sw["computron_model_swap_bytes_total"] / sw["computron_model_swaps_total"])
            assert 0 < row["p50_s"] <= row["p99_s"] and set(row["slo"]) == {str(k) for k in range(1, 9)}
    assert len(per_swap) == 1 and per_swap.pop() > 0  # one tiny-opt copy's bytes a swap, in every run
    assert rows["inference-alone"]["slo"]["8"] == 1.0  # within 8 x its model's median latency, alone
    for mode, row in rows.items():  # every request of the phase's repeats pooled, at 5 x solo
        if mode != "training-alone":
            sp = row["slo_pooled"]
            assert sp["requests"] == n and sp["share"] == sp["met"] / n, (mode, sp)
            assert sp["wilson95"][0] <= sp["share"] <= sp["wilson95"][1] <= 1.0, (mode, sp)
    assert rows["training-alone"]["train_relative"] == 1.0
    alone = runs["training-alone"][0]  # each step's peak memory, read off the job's step lines
    assert len(alone["train_step_peaks_mib"]) == len(alone["train_step_ends"]) > 0
    assert all(p > 0 for p in alone["train_step_peaks_mib"]), alone["train_step_peaks_mib"]
    assert all(isinstance(runs[m][0]["train_mosts"], list) for m in MODES)  # the jobs' mosts said in the run
    # the job trains beside the server (a loaded CPU may fit no step of a shrunk or paused job into one
    # 2 s run, and task-switch pauses it whenever inference has work; the bench waits for a step
    # under each arbiter before each run)
    assert all(rows[m]["train_samples_per_s"] >= 0 for m in MODES)
    assert max(rows[m]["train_samples_per_s"] for m in MODES) > 0
    assert rows["normal"]["handovers"] == 0 and rows["static"]["handovers"] == 0  # nothing is handed over
    # each static run held its own split: --static-train-gb, and the one static@GIB names
    assert runs["static"][0]["train_share_at_start"] == int(0.0037 * 2**30)
    assert runs["static@0.004"][0]["train_share_at_start"] == int(0.004 * 2**30)
    # training was told to yield the compute while inference had work, and only in that phase
    assert rows["colocate+yield"]["train_yields"] >= 1 and rows["colocate+yield-first"]["train_yields"] >= 1
    assert all(rows[m]["train_yields"] == 0 for m in MODES)
    for mode in ("task-switch", "colocate", "colocate+yield", "colocate+yield-first"):  # training held the memory inference asked for
        row = rows[mode]
        assert row["handovers"] >= 1 and row["train_shrinks"] >= 1, row
        for part in ("wait", "signal", "release", "ack", "alloc", "swap"):
            assert row[f"handover_{part}_p99_ms"] >= row[f"handover_{part}_p50_ms"] >= 0, (mode, part, row)
        run = runs[mode][0]
        assert run["timeline"] and run["used"] and max(u for _, u in run["used"]) > 0
        assert all(i + t <= run["capacity"] for _, i, t in run["timeline"])  # shares never double-booked
    assert (tmp_path / "hybrid_t.png").stat().st_size > 0


def test_a_failed_phase_ends_the_call_but_the_runs_before_it_are_summarized(tmp_path):
    """The server cannot start (a flag it does not know): the call exits 1 and says why, and its
    summary holds the training-alone run that came first, with the failure."""
    cmd = [sys.executable, str(ROOT / "bench" / "hybrid.py"), "--device", "cpu", "--preset", "tiny-opt",
           "--models", "1", "--train-model", "tiny-opt", "--seq-len", "16", "--global-batch", "8",
           "--micro-batch", "8", "--duration", "1", "--repeats", "1", "--warmup-steps", "1", "--job-timeout", "60",
           "--serve-args=--no-such-flag", "--tag", "f", "--out", str(tmp_path),
           "--modes", "inference-alone,training-alone"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "stopped: " in p.stderr and "--no-such-flag" in p.stderr, p.stderr[-3000:]
    out = json.loads((tmp_path / "hybrid_f.json").read_text())
    assert [r["mode"] for r in out["rows"]] == ["training-alone"]
    assert out["rows"][0]["train_samples_per_s"] > 0
    assert "--no-such-flag" in out["failed"]


def test_the_release_bench_compares_bounds_against_unbounded(tmp_path):
    # more capacity than the job can use: colocate caps it, idle inference keeps the rest, and each demand
    # must come on top of that to take memory from the job
    cmd = [sys.executable, str(ROOT / "bench" / "colocate_release.py"), "--device", "cpu", "--train-model", "tiny-opt",
           "--seq-len", "64", "--global-batch", "16", "--micro-batch", "8", "--capacity-gb", "0.05",
           "--demand-gb", "0.003", "--run-ahead", "0,8", "--fence-every", "4", "--rounds", "1", "--window", "2",
           "--handovers", "3",
           "--warmup-steps", "1", "--tag", "t", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = json.loads((tmp_path / "colocate_release_t.json").read_text())["rows"]
    assert [(r["run_ahead"], r["fence_every"]) for r in rows] == [(0, 1), (8, 4)]  # unbounded needs no spacing
    for r in rows:  # every demand took memory from the job: each one a timed release
        assert r["handovers"] == 3 and r["no_release"] == 0, r
        assert r["samples_per_s"] > 0 and r["release_p99_ms"] >= r["release_p50_ms"] >= 0
    assert rows[0]["relative"] == 1.0
    runs = json.loads((tmp_path / "colocate_release_t.json").read_text())["runs"]
    assert all(m and all(1 <= x <= 8 for x in m) for r in runs for m in r["micro_batches"])  # each window's sizes
    assert " 8/4 rounds: " in p.stdout


def test_the_release_bench_demands_on_top_of_what_idle_inference_keeps_beside_a_capped_job(tmp_path):
    """A job that says it uses at most 190 of 1000 bytes: colocate leaves idle inference 810, so the bench
    waits for that settled split (not for training to hold all 1000, which it never will) and demands on
    top of it; before the shares settle it says so rather than wait for ever."""
    import importlib.util

    from computron.colocate.arbiter import Arbiter, ArbiterConfig
    from computron.colocate.client import Colocation
    from computron.colocate.memmodel import MemoryModel
    from computron.colocate.protocol import ArbiterServer

    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("release_bench", ROOT / "bench" / "colocate_release.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()

    class Job:  # what the bench's error message reads of its job process
        p = ended
        last_lines = ["step 3"]

    addr = str(tmp_path / "arbiter.sock")
    server = ArbiterServer(Arbiter(ArbiterConfig(mode="colocate", capacity=1000, idle_s=0.5)), addr)
    memory = MemoryModel(100, 10, rel_margin=0.0)
    colo = Colocation(addr, memory=memory, reconnect_s=0.01)
    try:
        assert colo.wait_connected(5.0)
        server.demand(0, 600)  # inference busy with 600: not settled while it holds more than its idle share
        with pytest.raises(RuntimeError, match=r"did not settle within 0.2 s(.|\n)*exited with 0(.|\n)*step 3"):
            bench.wait_settled(server, Job(), timeout=0.2)
        server.demand(0, 0)
        memory.record(8, 190)  # 8 samples peaked at 190 bytes: the most the job can use
        assert colo.micro_batch(most=8) == 8
        assert bench.wait_settled(server, Job(), timeout=5.0) == 810
        assert server.records()["shares"][0] == [810, 190]
    finally:
        colo.close()
        server.close()


def _hybrid_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hybrid_bench", ROOT / "bench" / "hybrid.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_colocated_jobs_environment_reaches_its_process_and_a_bad_pair_is_refused(capsys):
    """--colocated-job-env (e.g. CUDA_MPS_ACTIVE_THREAD_PERCENTAGE under MPS) is the colocated job's
    alone: the process gets it on top of the bench's own environment."""
    import time


    hybrid = _hybrid_module()
    assert hybrid.env_pairs(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    code = ("import os; print('step 1/1 micro-batches [2] peak 1,234 MiB ' + os.environ['HYBRID_T'] + ' ' "
            "+ os.environ['PYTHONPATH'])")
    job = hybrid.Job([sys.executable, "-c", code], env=hybrid.env_pairs(["HYBRID_T=yes"]))
    job.p.wait(30)
    deadline = time.monotonic() + 10
    while not job.steps and time.monotonic() < deadline:  # the reader thread sees the line
        time.sleep(0.01)
    assert job.micro == [[2]] and job.peaks == [1234]  # the step's sizes and peak, read off its line
    assert job.last_lines[0].startswith("step 1/1 micro-batches [2] peak 1,234 MiB yes ")
    assert str(ROOT / "src") in job.last_lines[0]  # the bench's own environment is kept under it
    job = hybrid.Job([sys.executable, "-c", "import os; print(os.environ.get('HYBRID_T', 'unset'))"])
    job.p.wait(30)
    deadline = time.monotonic() + 10
    while not job.last_lines and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(job.last_lines) == ["unset"]
    with pytest.raises(SystemExit):
        hybrid.main(["--colocated-job-env", "NOEQUALS", "--out", "/nonexistent-never-made"])
    assert "--colocated-job-env takes KEY=VALUE, got 'NOEQUALS'" in capsys.readouterr().err
    for modes, said in (("static@30", "['static@30']: a static split gives training less than --capacity-gb (24 GiB)"),
                        ("colocate,static@x", "unknown phase(s) ['static@x']")):
        with pytest.raises(SystemExit):  # refused before anything starts
            hybrid.main(["--modes", modes, "--out", "/nonexistent-never-made"])
        assert said in capsys.readouterr().err


def test_the_gpu_sampler_reads_nvidia_smi_lines_and_summarises_each_run(tmp_path, monkeypatch):
    """Each run records the GPU's SM clock, temperature and power (nvidia-smi, every half second), so a
    job that is slower in a later run can be told apart from a GPU that clocked down as it heated."""
    import stat
    import time

    hybrid = _hybrid_module()
    assert hybrid.parse_gpu_sample("1980, 41, 125.31\n") == (1980.0, 41.0, 125.31)
    assert hybrid.parse_gpu_sample("[N/A], 41, 125.31") is None
    assert hybrid.GpuSampler("cpu").stop() is None  # nothing sampled on the CPU
    fake = tmp_path / "nvidia-smi"  # prints what nvidia-smi would, then waits to be stopped
    fake.write_text("#!/bin/sh\necho \"$@\" > " + str(tmp_path / "args") + "\n"
                    "printf '1980, 40, 300.5\\n1755, 55, 690.0\\n[N/A], 55, 1.0\\n1830, 61, 650.0\\n'\nexec sleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    sampler = hybrid.GpuSampler("cuda")
    deadline = time.monotonic() + 10
    while len(sampler.samples) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    got = sampler.stop()
    assert [s[1:] for s in got["samples"]] == [[1980.0, 40.0, 300.5], [1755.0, 55.0, 690.0], [1830.0, 61.0, 650.0]]
    assert got["sm_clock_mhz_median"] == 1830.0 and got["sm_clock_mhz_min"] == 1755.0
    assert got["temperature_c_max"] == 61.0 and got["power_w_median"] == 650.0
    assert "-i 3" in (tmp_path / "args").read_text()  # the first visible GPU, as the job sees it
    assert sampler.p.poll() is not None  # stopped with the run


def test_each_arbiter_phase_is_a_mode_and_a_yield():
    """A phase's name is the arbiter's mode and, after ``+``, when training yields the compute: the body
    ``POST /admin/colocation`` gets when the bench switches to it."""
    hybrid = _hybrid_module()
    got = {p: hybrid.arbiter_settings(p) for p in hybrid.ARBITER_PHASES}
    assert got["static+yield-first"] == {"mode": "static", "yield_compute": "first-token"}
    assert got["colocate+yield"] == {"mode": "colocate", "yield_compute": "work"}
    assert got["colocate+yield-cold"] == {"mode": "colocate", "yield_compute": "cold"}
    assert all(got[m] == {"mode": m, "yield_compute": "none"} for m in MODES)
    # static at a split of its own: training's share named in the phase, else --static-train-gb
    assert hybrid.arbiter_settings("static@12.5+yield-cold", 16.5) == \
        {"mode": "static", "yield_compute": "cold", "static_train": int(12.5 * 2**30)}
    assert hybrid.arbiter_settings("static", 16.5)["static_train"] == int(16.5 * 2**30)
    assert "static_train" not in hybrid.arbiter_settings("colocate", 16.5)
    for bad in ("colocate@12", "static@", "static@x", "static@-1", "static+", "static+yield-late",
                "task-switch+yield", "inference-alone", "colocate+yield+yield"):
        assert not hybrid.is_arbiter_phase(bad), bad
    assert hybrid.in_order(["static@16", "colocate", "static@9.5", "inference-alone", "static"]) == \
        ["inference-alone", "static", "colocate", "static@9.5", "static@16"]
