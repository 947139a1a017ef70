"""Time one scheduler step (schedule + update) on one core, as the simulator will drive it.

The workload is the heavy steady state of a busy server: one device whose budget holds one
model at a time; one resident model decoding a full batch of ``--batch`` requests; every other
model with requests queued that cannot load until the running batch drains (so each step also
checks whether the oldest waiting model could start). Measured twice: as it is (steps with
nothing new reuse the last decision and only grow KV blocks), and with a request arriving before
every step (the full search every time: the figure held against the targets). Swept over the number of models (8 → 512,
10 queued requests in all) and the number of queued requests (10 → 10,000, 64 models). The
reference in the same run is a step that only builds the plan's request lists, nothing else.

    python bench/scheduler_speed.py [--steps 2000] [--runs 5]

Writes bench/results/scheduler_speed.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from computron.bench.common import write_json  # noqa: E402
from computron.scheduler import SchedRequest, Scheduler, SchedulerConfig  # noqa: E402

TARGET_US = 20.0
WEIGHTS, KV_PER_TOKEN = 100 * 2**20, 256


def build(models: int, queued: int, batch: int) -> Scheduler:
    s = Scheduler(SchedulerConfig(budgets=(150 * 2**20,), max_batch_size=batch))
    for i in range(models):
        s.add_model(f"m{i}", WEIGHTS, KV_PER_TOKEN)
    t = 0.0
    for j in range(batch):  # the running batch of m0 (nothing ends while the steps are timed)
        s.add_request(SchedRequest(f"run{j}", "m0", 16, 4000, t))
        t += 1.0
    for j in range(queued):  # round-robin over the other models, all newer than the batch
        s.add_request(SchedRequest(f"q{j}", f"m{1 + j % (models - 1)}", 16, 64, t))
        t += 1.0
    s.update(s.schedule(0.0))  # admit the batch and load m0
    return s


def time_steps(s: Scheduler, steps: int, arrivals: bool = False) -> float:
    """Mean seconds per step over ``steps`` consecutive steps. With ``arrivals``, one request
    arrives for a queued model before every step, so no step can reuse the last one's decision
    (the full search runs every time; the add is timed too). A request that only joins the back of
    a queue changes no plan, so the scheduler would skip the search for it: the last decision is
    dropped by hand to time the search."""
    others = [n for n in s.models if n != "m0"]
    t0 = time.perf_counter()
    for i in range(steps):
        if arrivals:
            s.add_request(SchedRequest(f"a{i}", others[i % len(others)], 16, 64, 1e6 + i))
            s._steady = None
        s.update(s.schedule(float(i)))
    return (time.perf_counter() - t0) / steps


def reference(batch: int, steps: int) -> float:
    """The floor: building one batch's request lists and counting its tokens, nothing else."""
    running = {f"run{j}": 0 for j in range(batch)}
    t0 = time.perf_counter()
    for _ in range(steps):
        ids = list(running)
        for rid in ids:
            running[rid] += 1
    return (time.perf_counter() - t0) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "scheduler_speed.json"))
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    cases = [("models", m, 10) for m in (8, 64, 512)] + [("queued", 64, q) for q in (10, 1000, 10_000)]
    rows = []
    for arrivals in (False, True):
        for sweep, models, queued in cases:
            runs = []
            for _ in range(args.runs):
                s = build(models, queued, args.batch)
                runs.append(time_steps(s, args.steps, arrivals) * 1e6)
                assert len(s.models["m0"].running) == args.batch and s.state("m0") != "offloaded"
            rows.append({"sweep": sweep, "arrival_every_step": arrivals, "models": models, "queued": queued,
                         "batch": args.batch, "step_us_median": statistics.median(runs), "step_us_runs": runs})
    ref = statistics.median(reference(args.batch, args.steps) * 1e6 for _ in range(args.runs))
    by = {(r["arrival_every_step"], r["sweep"], r["models"], r["queued"]): r["step_us_median"] for r in rows}
    # The figures held against the targets are the full search's (an arrival before every step).
    growth_models = by[(True, "models", 512, 10)] / by[(True, "models", 8, 10)]
    growth_queue = by[(True, "queued", 64, 10_000)] / by[(True, "queued", 64, 10)]
    at64 = by[(True, "queued", 64, 10)]
    steady64 = by[(False, "queued", 64, 10)]
    out = {
        "benchmark": "scheduler step (schedule + update), one core",
        "workload": "one device holding one model; a resident model decoding a full batch; every other model "
                    "queued behind it, unable to load until the batch drains",
        "steps_per_run": args.steps, "runs": args.runs, "rows": rows,
        "reference_us": ref, "reference": "building the batch's request list and counting its tokens only",
        "step_us_at_64_models_batch_32": at64, "steady_step_us_at_64_models_batch_32": steady64,
        "target_us": TARGET_US, "meets_target": at64 <= TARGET_US,
        "growth_8_to_512_models": growth_models, "growth_10_to_10000_queued": growth_queue,
        "growth_target": 2.0, "meets_growth_target": growth_models <= 2.0 and growth_queue <= 2.0,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "cores_used": 1},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    write_json(args.out, out)
    print(f"{'sweep':8} {'arrivals':>8} {'models':>7} {'queued':>7} {'step µs':>9}")
    for r in rows:
        print(f"{r['sweep']:8} {str(r['arrival_every_step']):>8} {r['models']:>7} {r['queued']:>7} "
              f"{r['step_us_median']:>9.2f}")
    print(f"reference {ref:.2f} µs; 64 models, batch {args.batch}, an arrival every step: {at64:.2f} µs "
          f"(target ≤ {TARGET_US}; steady decode {steady64:.2f} µs); growth 8→512 models {growth_models:.2f}×, "
          f"10→10,000 queued {growth_queue:.2f}× (target ≤ 2×)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
