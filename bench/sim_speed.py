"""How fast the simulator runs: simulated requests per second of wall time, on one CPU core.

A 3-model workload (Gamma inter-arrival times, CV 2, per model) of ~20k requests through
``computron.sim.simulate`` (the real EngineCore and Scheduler on a SimExecutor), with an
H200-like calibration and a budget that holds two of the three models, run ``--runs`` times on
one core (the median is the figure; CPU seconds of the process beside wall seconds, as other work
on the machine stretches wall time). A profiled run on a slice of the trace says where the time
goes. Writes bench/results/sim_speed.json. ``--reference-src`` at another checkout's ``src`` (e.g.
``git worktree add --detach /tmp/ref main``) measures that version too, in the same run: each run
is a fresh process of each version in turn, on the same workload, and the two must simulate the same
(steps, end time, latencies) or the script fails. ``--compare-compiled`` does the same with this
checkout's Python modules as the reference and its mypyc build (``scripts/build_fast.sh``,
``COMPUTRON_COMPILED=1``) as the version measured; the JSON's ``path`` says which ran (``compiled``
when this process itself runs the build: then the profile sees only the Python left around it).
``--reference-src`` under ``COMPUTRON_COMPILED=1`` compares two builds, each checkout's own (its
``build/fast``), and fails unless both ran compiled.

    .venv/bin/python bench/sim_speed.py [--requests 20000] [--runs 5] [--profile-requests 4000]
        [--reference-src /tmp/ref/src | --compare-compiled]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from computron.config import EngineConfig
from computron.sim import Simulation
from computron.sim.costs import H200_ROUGH

try:
    from computron import _fast
except ImportError:  # a --reference-src checkout from before the compiled build
    _fast = None

MODELS = ["opt-6.7b", "llama-2-7b", "opt-1.3b"]
H200ISH = H200_ROUGH


def gamma_trace(n: int, models: list[str], rate: float, cv: float, seed: int) -> list[tuple]:
    """n requests over the models (equal rates), Gamma inter-arrivals of mean 1/rate and CV ``cv`` per model."""
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv)
    out = []
    per = n // len(models)
    for m in models:
        t = 0.0
        for _ in range(per):
            t += rng.gammavariate(shape, 1.0 / (rate * shape))
            out.append((t, m, rng.randint(16, 512), rng.randint(8, 256)))
    out.sort(key=lambda a: a[0])
    return out


def run(trace, cfg):
    """The simulation's result, its core calls, and wall and CPU seconds."""
    sim = Simulation(MODELS, H200ISH, cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    res = sim.run(trace)
    return res, sim.schedule_calls, time.perf_counter() - t0, time.process_time() - c0


def path() -> str:
    """Which modules ran: ``compiled`` (the mypyc build, all of it) or ``python``."""
    got = _fast.compiled_modules() if _fast else []
    if got and len(got) != len(_fast.MODULES):
        raise SystemExit(f"only part of the build was loaded: {got}")
    return "compiled" if got else "python"


def outcome(res) -> dict:
    """What a simulation decided: two versions that simulate alike give the same."""
    summ = res.summary()["all"]
    return {"steps": res.steps, "end_time": round(res.end_time, 9), "completed": summ["completed"],
            "latency_mean": round(summ["latency"]["mean"], 9), "ttft_mean": round(summ["ttft"]["mean"], 9)}


def child(a, cfg) -> None:
    """One run of the checkout on PYTHONPATH; its figures as JSON on stdout."""
    res, calls, w, c = run(gamma_trace(a.requests, MODELS, a.rate, a.cv, seed=0), cfg)
    print(json.dumps({"wall_s": w, "cpu_s": c, "core_calls": calls, "outcome": outcome(res), "path": path()}))


def in_process(src: str, a, compiled: bool | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": src}
    if compiled is not None:
        env["COMPUTRON_COMPILED"] = "1" if compiled else "0"
    out = subprocess.run([sys.executable, __file__, "--child", "--requests", str(a.requests), "--rate", str(a.rate),
                          "--cv", str(a.cv)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--rate", type=float, default=8.0, help="requests/s per model")
    ap.add_argument("--cv", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--label", default="", help="what version is measured (recorded in the JSON)")
    ap.add_argument("--profile-requests", type=int, default=4000)
    ap.add_argument("--reference-src", default=None, help="another checkout's src, measured in the same run")
    ap.add_argument("--compare-compiled", action="store_true",
                    help="this checkout's Python modules as the reference, its compiled build measured")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sim_speed.json"))
    a = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    cfg = EngineConfig(gpu_memory_budget=30 * 2**30)  # 27 GiB arena: two of the three models, not all
    if a.child:
        return child(a, cfg)
    if a.compare_compiled and a.reference_src:
        raise SystemExit("--compare-compiled and --reference-src: one reference at a time")
    if a.compare_compiled and path() != "compiled":
        raise SystemExit(f"--compare-compiled needs the build loaded in this process: {_fast.ENV}=1 "
                         f"({_fast.check()[1] or 'set it'})")
    trace = gamma_trace(a.requests, MODELS, a.rate, a.cv, seed=0)
    walls, cpus, ref = [], [], {"wall_s_runs": [], "cpu_s_runs": []}
    this_src = str(Path(__file__).resolve().parent.parent / "src")
    for _ in range(a.runs):
        if a.reference_src or a.compare_compiled:  # each version in a fresh process, in turn
            r = in_process(a.reference_src or this_src, a, False if a.compare_compiled else None)
            ref["wall_s_runs"].append(r["wall_s"])
            ref["cpu_s_runs"].append(r["cpu_s"])
            ref["outcome"], ref["core_calls"], ref["path"] = r["outcome"], r["core_calls"], r["path"]
            mine = in_process(this_src, a, True if a.compare_compiled else None)
            if a.compare_compiled and (r["path"], mine["path"]) != ("python", "compiled"):
                raise SystemExit(f"expected python against compiled, ran {r['path']} against {mine['path']}")
            if a.reference_src and r["path"] != mine["path"]:  # COMPUTRON_COMPILED=1: each its own build
                raise SystemExit(f"the reference ran {r['path']}, this checkout {mine['path']}: build both or neither")
            walls.append(mine["wall_s"])
            cpus.append(mine["cpu_s"])
            if mine["outcome"] != r["outcome"]:
                raise SystemExit(f"the versions simulate differently: {mine['outcome']} against {r['outcome']}")
        else:
            res, calls, w, c = run(trace, cfg)
            walls.append(w)
            cpus.append(c)
    res, calls, _, _ = run(trace, cfg)  # this version's outcome and calls, in this process
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    summ = res.summary()
    tokens = summ["all"]["output_tokens"]
    if a.reference_src or a.compare_compiled:
        rw, rc = statistics.median(ref["wall_s_runs"]), statistics.median(ref["cpu_s_runs"])
        ref.update({"src": a.reference_src or f"{this_src} (Python modules)", "wall_s": round(rw, 3), "cpu_s": round(rc, 3),
                    "requests_per_s": round(len(trace) / rw, 1), "requests_per_cpu_s": round(len(trace) / rc, 1),
                    "speedup_wall": round(rw / wall, 3), "speedup_cpu": round(rc / cpu, 3)})

    prof = cProfile.Profile()
    small = trace[: a.profile_requests]
    prof.enable()
    pres, _, pwall, _ = run(small, cfg)
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(15)
    top = []
    for (file, line, fn), (cc, nc, tt, ct, _) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:15]:
        top.append({"function": f"{Path(file).name}:{line}:{fn}", "calls": nc, "tottime_s": round(tt, 4),
                    "share": round(tt / st.total_tt, 4)})

    out = {
        "what": "simulated requests per second of wall time (one core), real EngineCore+Scheduler on SimExecutor",
        "label": a.label,
        "path": path(), "compiled_modules": _fast.compiled_modules() if _fast else [],
        "models": MODELS, "calibration": H200ISH.to_dict(), "gpu_memory_budget": cfg.gpu_memory_budget,
        "workload": {"requests": len(trace), "rate_per_model": a.rate, "cv": a.cv, "prompt_tokens": [16, 512],
                     "output_tokens": [8, 256]},
        "runs": a.runs, "wall_s": round(wall, 3), "requests_per_s": round(len(trace) / wall, 1),
        "cpu_s": round(cpu, 3), "requests_per_cpu_s": round(len(trace) / cpu, 1),
        "wall_s_runs": [round(w, 3) for w in walls], "cpu_s_runs": [round(c, 3) for c in cpus],
        "core_calls": calls, "steps": res.steps, "steps_per_s": round(res.steps / wall, 1), "output_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1), "simulated_s": round(res.end_time, 3),
        "core_stats": res.stats, "completed": summ["all"]["completed"], "outcome": outcome(res),
        "reference": ref if a.reference_src or a.compare_compiled else None,
        "latency_s": summ["all"]["latency"], "ttft_s": summ["all"]["ttft"],
        "profile": {"requests": len(small), "wall_s_profiled": round(pwall, 3), "top_tottime": top},
        "python": sys.version.split()[0], "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("requests_per_s", "requests_per_cpu_s", "wall_s", "cpu_s", "core_calls",
                                           "steps", "simulated_s", "completed")}, indent=1))
    print(f"path: {out['path']}")
    if a.reference_src or a.compare_compiled:
        print(f"reference {ref['src']}: {ref['requests_per_s']} requests/s ({ref['requests_per_cpu_s']} per CPU s); "
              f"speedup {ref['speedup_wall']}x wall, {ref['speedup_cpu']}x CPU; same outcome {ref['outcome']}")
    print(s.getvalue()[:4000])


if __name__ == "__main__":
    main()
