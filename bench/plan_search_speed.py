"""Time the planner's search on its target cases, the whole space, on one core.

Runs the full search (every sub-cluster, every distinct placement, tp/pp/dp, micro-batch size,
partition method; recomputation when needed) several times per case in this one process and
writes the medians (wall and CPU seconds) to bench/results/plan_search_speed.json. Cases:
MODEL@CLUSTER; by default GPT-2 1.5B on 32 GPUs of two types, and GPT-2 1.5B, GPT-3 13B on a
64-GPU mix of three types and GPT-3 175B on 1,024 A100s. ``--reference-src DIR`` times another
copy of the sources (e.g. ``git archive REV src | tar -x -C /tmp/ref``) in the same run, on the
same core, and checks that it returns the same best plan (meaningful when both search the same
space: ``--zero 0`` restricts this code to the reference's no-ZeRO space; the reference run is
given no ``--zero``). The machine may be shared: CPU seconds are recorded next to wall seconds.

    python bench/plan_search_speed.py [--case gpt2-1.5b@a100-80gb:8x2,v100:8x2 ...] [--runs 3]
                                      [--virtual-stages 1,2,4] [--zero 0] [--reference-src /tmp/ref/src]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

if "--src" in sys.argv:  # time another copy of the sources (the reference)
    sys.path.insert(0, sys.argv[sys.argv.index("--src") + 1])
else:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from computron.planner.hardware import parse_compact  # noqa: E402
from computron.planner.model import preset  # noqa: E402
from computron.planner.search import SearchOptions, search  # noqa: E402

TARGET_S = 5.0


CASES = ["gpt2-1.5b@a100-80gb:8x2,v100:8x2", "gpt2-1.5b@a100-80gb:8x4,a100-40gb:8x2,a10:4x4",
         "gpt3-13b@a100-80gb:8x4,a100-40gb:8x2,a10:4x4", "gpt3-175b@a100-80gb:8x128"]


def run_case(model: str, spec: str, runs: int, v: tuple[int, ...], extra: dict) -> dict:
    m, cluster = preset(model), parse_compact(spec)
    times, cpu, res = [], [], None
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        res = search(m, cluster, SearchOptions(top=1, virtual_stages=v, **extra))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    best = res.plans[0]
    med = statistics.median(times)
    zero = getattr(best.config, "zero", getattr(best.config, "zero1", False))
    print(f"{model} on {spec}: median {med:.2f} s over {runs} (min {min(times):.2f}, max {max(times):.2f}; "
          f"CPU {statistics.median(cpu):.2f} s); best {best.dims} mbs={best.config.mbs} v={best.config.v} "
          f"zero={int(zero)} {best.iteration_s:.4f} s", flush=True)
    return {"model": model, "cluster": spec, "gpus": cluster.total_gpus, "runs": runs, "median_s": med,
            "min_s": min(times), "max_s": max(times), "cpu_median_s": statistics.median(cpu),
            "meets_target": med <= TARGET_S, "meets_target_cpu": statistics.median(cpu) <= TARGET_S,
            "stats": {k: v for k, v in res.stats.items() if k != "seconds"},
            "best_plan": {"dims": str(best.dims), "mbs": best.config.mbs, "v": best.config.v,
                          "recompute": best.config.recompute, "selective": best.config.selective, "zero": int(zero),
                          "placement": list(best.placement),
                          "partition": list(best.partition), "iteration_s": best.iteration_s}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", help="MODEL@CLUSTER (repeatable); default: the four target cases")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "plan_search_speed.json"))
    ap.add_argument("--virtual-stages", default="1", help="model chunks per stage to search, e.g. 1,2,4")
    ap.add_argument("--zero", help="ZeRO stages to search, e.g. 0 (the reference's space); default: the search's")
    ap.add_argument("--reference-src", help="another copy of src/ to time in the same run (the reference)")
    ap.add_argument("--src", help=argparse.SUPPRESS)  # used by the reference run
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    case_args = args.case or CASES
    v = tuple(int(x) for x in args.virtual_stages.split(","))
    extra = {"zero": tuple(int(x) for x in args.zero.split(","))} if args.zero else {}
    cases = [run_case(*c.split("@", 1), args.runs, v, extra) for c in case_args]
    if args.reference_src:
        with tempfile.TemporaryDirectory() as tmp:
            ref_out = os.path.join(tmp, "ref.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--src", args.reference_src, "--runs", str(args.runs),
                   "--out", ref_out, "--virtual-stages", args.virtual_stages] + [x for c in case_args for x in ("--case", c)]
            print("reference:", flush=True)
            subprocess.run(cmd, check=False)
            with open(ref_out) as f:
                ref = json.load(f)["cases"]
        for c, r in zip(cases, ref):
            c["reference"] = {k: r[k] for k in ("median_s", "min_s", "max_s", "cpu_median_s", "best_plan")}
            c["speedup"] = r["median_s"] / c["median_s"]
            c["same_best_plan"] = abs(r["best_plan"]["iteration_s"] - c["best_plan"]["iteration_s"]) <= 1e-9 * c["best_plan"]["iteration_s"]
            print(f"{c['model']} on {c['cluster']}: {c['median_s']:.2f} s against {r['median_s']:.2f} s "
                  f"({c['speedup']:.2f}x), same best plan: {c['same_best_plan']}", flush=True)
    out = {
        "benchmark": "planner search speed (top 1, one core)",
        "reference": args.reference_src,
        "space": f"all sub-clusters, all distinct node orderings, tp/cp/pp/dp, mbs <= 64, v in {list(v)}, partitions "
                 f"balanced/greedy/exact, recompute auto, ZeRO stages {args.zero or 'default'}",
        "target_s": TARGET_S, "cases": cases,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "cores_used": 1},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(f"-> {args.out}")
    return 0 if all(c["meets_target"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
