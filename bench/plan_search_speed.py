"""Time the planner's search target: GPT-2 1.5B on 32 GPUs of two types, the whole space.

Runs the full search (every sub-cluster, every distinct placement, tp/pp/dp, micro-batch size,
partition method; recomputation when needed) several times in this one process on one core and
writes the median to bench/results/plan_search_speed.json.

    python bench/plan_search_speed.py [--cluster a100-80gb:8x2,v100:8x2] [--runs 7]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from computron.planner.hardware import parse_compact  # noqa: E402
from computron.planner.model import preset  # noqa: E402
from computron.planner.search import SearchOptions, search  # noqa: E402

TARGET_S = 5.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-1.5b")
    ap.add_argument("--cluster", default="a100-80gb:8x2,v100:8x2")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "plan_search_speed.json"))
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    m, cluster = preset(args.model), parse_compact(args.cluster)
    times, res = [], None
    for _ in range(args.runs):
        t0 = time.perf_counter()
        res = search(m, cluster, SearchOptions())
        times.append(time.perf_counter() - t0)
    best = res.plans[0]
    out = {
        "benchmark": "planner search speed",
        "model": args.model, "cluster": args.cluster, "gpus": cluster.total_gpus,
        "space": "all sub-clusters, all distinct node orderings, tp/pp/dp, mbs <= 64, partitions balanced/greedy/exact, recompute auto",
        "runs": args.runs, "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
        "target_s": TARGET_S, "meets_target": statistics.median(times) <= TARGET_S,
        "stats": {k: v for k, v in res.stats.items() if k != "seconds"},
        "best_plan": {"dims": str(best.dims), "mbs": best.config.mbs, "placement": list(best.placement),
                      "partition": list(best.partition), "iteration_s": best.iteration_s},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "cores_used": 1},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(f"{args.model} on {args.cluster}: median {out['median_s']:.3f} s over {args.runs} runs "
          f"(min {out['min_s']:.3f}, max {out['max_s']:.3f}; target {TARGET_S} s) -> {args.out}")
    print(f"{res.stats['candidates']} candidates, {res.stats['simulated']} simulated; best {out['best_plan']}")
    return 0 if out["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
