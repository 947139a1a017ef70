"""The engine thread's own Python per step under the validation trace's load (issue 11).

The simulator charges calibrated step costs only; the scheduler and the core's bookkeeping run for
real in it but their wall time is not charged. A calibration (one model, no queue) measures them only
as they cost with nothing waiting. This replays the committed H100 validation trace through the
simulator one step per core call (as the server steps) and times, per step, ``Scheduler.schedule`` and
the whole ``EngineCore.step`` minus the simulated executor's ``execute`` call, against the number
of requests queued and running at that step. Wall times are this CPU's, not the H100 host's.

    PYTHONPATH=src python bench/sim_sched_cost.py [--calibration FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from computron.config import EngineConfig
from computron.sim import Simulation
from computron.sim.costs import Calibration
from computron.workload import make_workload

D = Path(__file__).parent / "results" / "sim_validate_h100"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibration", default=str(D / "calibration_gpu_legacy_served.json"))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sim_sched_cost_cpu.json"))
    a = ap.parse_args()
    trace = make_workload(["a", "b", "c"], rate=4.0, duration=120, cv=2.0, prompt=(32, 512), output=(16, 256),
                          seed=1)  # the trace of bench/gpu_sim_validate.sh
    sim = Simulation(["opt-1.3b=a", "opt-1.3b=b", "opt-1.3b=c"], Calibration.load(a.calibration),
                     EngineConfig(device="cpu", policy="computron", max_loaded=2, gpu_memory_budget="8GiB"),
                     fast_forward=False)
    core, sched, exe = sim.core, sim.core.scheduler, sim.executor
    rows, acc = [], {"sched": 0.0, "exec": 0.0}
    sched_fn, exec_fn, step_fn = sched.schedule, exe.execute, core.step

    def timed(fn, key):
        def call(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                acc[key] += time.perf_counter() - t0
        return call

    schedule, execute = timed(sched_fn, "sched"), timed(exec_fn, "exec")

    def step(*args, **kw):
        acc["sched"] = acc["exec"] = 0.0
        waiting = sum(1 for r in core.requests.values() if not r.output_ids)
        t0 = time.perf_counter()
        plan = step_fn(*args, **kw)
        wall = time.perf_counter() - t0
        if plan.batches:
            rows.append((waiting, len(core.requests) - waiting, len(plan.batches),
                         sum(len(b.decode) for b in plan.batches), sum(len(b.prefill) for b in plan.batches),
                         acc["sched"], wall - acc["exec"]))
        return plan

    sched.schedule, exe.execute, core.step = schedule, execute, step
    res = sim.run(trace)
    x = np.array(rows)
    out = {"steps": len(rows), "latency_mean_s": res.summary()["all"]["latency"]["mean"], "by_waiting": []}
    print(f"{len(rows)} steps; simulated latency mean {out['latency_mean_s']:.2f} s")
    print("waiting     steps  batches  decode  sched us  core-python us (median)")
    for lo, hi in [(0, 1), (1, 10), (10, 30), (30, 60), (60, 100), (100, 1000)]:
        m = (x[:, 0] >= lo) & (x[:, 0] < hi)
        if not m.any():
            continue
        row = {"waiting": [lo, hi], "steps": int(m.sum()), "batches": float(x[m, 2].mean()),
               "decode_seqs": float(x[m, 3].mean()), "schedule_us": float(np.median(x[m, 5]) * 1e6),
               "core_python_us": float(np.median(x[m, 6]) * 1e6)}
        out["by_waiting"].append(row)
        print(f"[{lo:3d},{hi:4d})  {row['steps']:6d}  {row['batches']:6.2f}  {row['decode_seqs']:6.1f}  "
              f"{row['schedule_us']:8.0f}  {row['core_python_us']:8.0f}")
    c, *_ = np.linalg.lstsq(np.c_[np.ones(len(x)), x[:, 0], x[:, 3]], x[:, 6], rcond=None)
    out["core_python_fit_s"] = {"fixed": c[0], "per_waiting": c[1], "per_decode_seq": c[2]}
    print("core python = %.0f us + %.2f us x waiting + %.2f us x decode seqs" % tuple(c * 1e6))
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
