"""Predicted against published iteration times of Megatron-LM GPT training on A100 clusters.

Published figures (facts quoted from the papers, not fitted):
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Tables 4/5, full-recomputation baseline: seconds per iteration (tp=8, mbs=1, dp=1).
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", Table 1 (weak scaling, full recomputation): achieved TFLOP/s per GPU, turned into
  seconds per iteration with the paper's own count 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)).
  The micro-batch size and the interleaving the paper used per row are not in the table;
  mbs=1 and v=1 are assumed here (see docs/planner.md).
Both: GPT, sequence 2048, vocabulary 51200, Selene (DGX A100 80GB, 8x200 Gb/s HDR IB per node).

    python bench/plan_validate_megatron.py   -> bench/results/plan_validate_megatron.json
"""

from __future__ import annotations

import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from computron.parallel.dims import ParallelDims  # noqa: E402
from computron.planner.estimate import CostModel, PlanConfig, PlanContext  # noqa: E402
from computron.planner.hardware import parse_compact  # noqa: E402
from computron.planner.layout import stage_envs  # noqa: E402
from computron.planner.model import TransformerShape  # noqa: E402

KORTHIKANTI = [  # name, layers, hidden, heads, tp, pp, global batch, seconds
    ("22B", 48, 6144, 64, 8, 1, 4, 1.42),
    ("175B", 96, 12288, 96, 8, 8, 64, 18.13),
    ("530B", 105, 20480, 128, 8, 35, 280, 49.05),
    ("1T", 128, 25600, 160, 8, 64, 512, 94.42),
]
NARAYANAN = [  # name, heads, hidden, layers, tp, pp, GPUs, global batch, achieved TFLOP/s per GPU
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def predict(m: TransformerShape, tp: int, pp: int, dp: int, mbs: int = 1, v: int = 1) -> dict:
    nodes = tp * pp * dp // 8
    cluster = parse_compact(f"a100-80gb:8x{nodes}")
    placement = (cluster.node_types[0],) * nodes
    dims = ParallelDims(dp=dp, tp=tp, pp=pp)
    cm = CostModel(m)
    ctx = PlanContext(cm, stage_envs(placement, dims, cm.a), PlanConfig(dims, mbs, v, recompute=True))
    r = ctx.result(ctx.partition("balanced", respect_memory=False), "balanced", placement)
    return {"predicted_s": r.iteration_s, "fits": r.feasible,
            "breakdown_s": {k: round(x, 4) for k, x in r.breakdown.items()},
            "max_memory_gib": round(max(r.stage_memory) / 2**30, 2)}


def main() -> int:
    rows = []
    for name, L, h, a, tp, pp, B, sec in KORTHIKANTI:
        m = TransformerShape(f"gpt-{name}", "gpt", L, h, a, 4 * h, 51200, 2048, B)
        rows.append({"source": "Korthikanti 2022 (full recompute)", "model": name, "tp": tp, "pp": pp, "dp": 1,
                     "gpus": tp * pp, "global_batch": B, "published_s": sec, **predict(m, tp, pp, 1)})
    for name, a, h, L, tp, pp, gpus, B, tflops in NARAYANAN:
        m = TransformerShape(f"gpt-{name}", "gpt", L, h, a, 4 * h, 51200, 2048, B)
        flops = 96 * B * 2048 * L * h * h * (1 + 2048 / (6 * h) + 51200 / (16 * L * h))
        dp = gpus // (tp * pp)
        rows.append({"source": "Narayanan 2021 Table 1 (mbs=1, v=1 assumed)", "model": name, "tp": tp, "pp": pp,
                     "dp": dp, "gpus": gpus, "global_batch": B, "published_s": flops / (gpus * tflops * 1e12),
                     **predict(m, tp, pp, dp)})
    for r in rows:
        r["error"] = r["predicted_s"] / r["published_s"] - 1
        print(f"{r['source'][:22]:22s} {r['model']:>7s} tp={r['tp']} pp={r['pp']:2d} dp={r['dp']:3d}: "
              f"published {r['published_s']:7.2f} s, predicted {r['predicted_s']:7.2f} s ({r['error']:+.1%})")
    errs = [abs(r["error"]) for r in rows]
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "mean_abs_error": sum(errs) / len(errs), "max_abs_error": max(errs), "rows": rows}
    path = os.path.join(HERE, "results", "plan_validate_megatron.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(f"mean |error| {out['mean_abs_error']:.1%}, max {out['max_abs_error']:.1%} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
