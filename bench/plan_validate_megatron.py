"""Predicted against published iteration times of Megatron-LM GPT training on A100 clusters,
with each run's published configuration (micro-batch, interleaving, recomputation, sequence
parallelism) and a fixed split of the rows into a calibration set and a held-out set.

Published figures (facts quoted from the papers and their reproduction scripts, not fitted):
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", Table 1 (weak scaling): achieved TFLOP/s per GPU, turned into seconds per
  iteration with the paper's own count 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)). The table does not
  give micro-batch size or interleaving; the paper's reproduction script for that table
  (Megatron-LM repository, examples/sc21/run_table_1.sh) does: micro-batch size, layers per
  virtual pipeline stage (v = layers / (pp * that)), full recomputation of every layer
  ("--recompute-method uniform", one layer per checkpoint), and the data-parallel wrapper
  (torch DDP for 1.7B-18.4B, Megatron's local DDP above).
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Table 3 (configurations: tp, pp, GPUs, global batch, micro-batch 4 for 22B and 1 otherwise) and
  Table 5 (seconds per iteration): the full-recomputation baseline and "present work" (sequence
  parallelism + selective recomputation). The paper does not state interleaving; v=1 is assumed.
Both: GPT, sequence 2048, vocabulary 51200, mixed precision, Selene (DGX A100 80GB, 8x200 Gb/s
HDR IB per node).

Split (fixed before any constant was fitted; alternate rows by model size within each source):
calibration = Narayanan 1.7B, 7.5B, 39.1B, 145.6B, 529.6B and Korthikanti 22B, 530B (both
variants); held-out = Narayanan 3.6B, 18.4B, 76.1B, 310.1B, 1008B and Korthikanti 175B, 1T (both
variants). Only the calibration rows may be used to choose the cost model's fitted constants.

    python bench/plan_validate_megatron.py         -> bench/results/plan_validate_megatron.json
    python bench/plan_validate_megatron.py --fit   (least-squares fit of the fitted constants
                                                    of costs.Assumptions on the calibration rows)
    python bench/plan_validate_megatron.py --reference-src /tmp/ref/src
                                                   (also predicts every row with another copy of
                                                    the sources, in the same run, and records both)
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
# --src DIR: predict with another copy of the sources (the reference run)
sys.path.insert(0, sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else os.path.join(HERE, "..", "src"))

from computron.parallel.dims import ParallelDims  # noqa: E402
from computron.planner.costs import DEFAULT, Assumptions  # noqa: E402
from computron.planner.estimate import CostModel, PlanConfig, PlanContext  # noqa: E402
from computron.planner.hardware import GPU_TYPES, parse_compact  # noqa: E402
from computron.planner.layout import stage_envs  # noqa: E402
from computron.planner.model import TransformerShape  # noqa: E402

CAL, HELD = "calibration", "held-out"

# name, heads, hidden, layers, tp, pp, GPUs, global batch, TFLOP/s per GPU (Table 1);
# mbs, layers per virtual stage (None: no interleaving), torch DDP (run_table_1.sh); split
NARAYANAN = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, None, True, CAL),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, None, True, HELD),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, None, True, CAL),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, None, True, HELD),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, None, False, CAL),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5, False, HELD),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5, False, CAL),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3, False, HELD),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1, False, CAL),
    ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, None, False, HELD),
]
# name, layers, hidden, heads, tp, pp, global batch, mbs (Table 3);
# seconds full recompute, seconds sequence parallel + selective (Table 5); split
KORTHIKANTI = [
    ("22B", 48, 6144, 64, 8, 1, 4, 4, 1.42, 1.10, CAL),
    ("175B", 96, 12288, 96, 8, 8, 64, 1, 18.13, 13.75, HELD),
    ("530B", 105, 20480, 128, 8, 35, 280, 1, 49.05, 37.83, CAL),
    ("1T", 128, 25600, 160, 8, 64, 512, 1, 94.42, 71.49, HELD),
]


def rows() -> list[dict]:
    """Every published run as a dict: shape, configuration, published seconds, split, notes."""
    out = []
    for name, a, h, L, tp, pp, gpus, B, tflops, mbs, lpv, torch_ddp, split in NARAYANAN:
        flops = 96 * B * 2048 * L * h * h * (1 + 2048 / (6 * h) + 51200 / (16 * L * h))
        notes = ["torch DDP: gradient all-reduce overlapped with the last backward (dp_overlap)"] if torch_ddp else []
        out.append({"source": "Narayanan 2021 Table 1", "model": name, "layers": L, "hidden": h, "heads": a,
                    "tp": tp, "pp": pp, "dp": gpus // (tp * pp), "mbs": mbs, "v": L // (pp * lpv) if lpv else 1,
                    "recompute": "full", "sequence_parallel": False, "dp_overlap": torch_ddp, "global_batch": B,
                    "published_s": flops / (gpus * tflops * 1e12), "set": split, "notes": notes})
    for name, L, h, a, tp, pp, B, mbs, full_s, sel_s, split in KORTHIKANTI:
        base = {"model": name, "layers": L, "hidden": h, "heads": a, "tp": tp, "pp": pp, "dp": 1, "mbs": mbs, "v": 1,
                "dp_overlap": False, "global_batch": B, "set": split}
        notes = ["interleaving not stated in the paper; v=1 assumed"] if pp > 1 else []
        out.append({"source": "Korthikanti 2022 Table 5, full recompute", **base, "recompute": "full",
                    "sequence_parallel": False, "published_s": full_s, "notes": list(notes)})
        out.append({"source": "Korthikanti 2022 Table 5, sequence parallel + selective", **base,
                    "recompute": "selective", "sequence_parallel": True, "published_s": sel_s, "notes": list(notes)})
    return out


def expressible(r: dict) -> str | None:
    """Why the planner cannot express this run's configuration, or None."""
    return None  # every row is expressible since sequence parallelism and selective recomputation


def predict(r: dict, a: Assumptions = DEFAULT, gemm_eff: float | None = None) -> dict:
    """Estimate one row; ``gemm_eff`` overrides the A100's asymptotic GEMM efficiency (for the fit)."""
    m = TransformerShape(f"gpt-{r['model']}", "gpt", r["layers"], r["hidden"], r["heads"], 4 * r["hidden"], 51200,
                         2048, r["global_batch"])
    tp, pp, dp = r["tp"], r["pp"], r["dp"]
    nodes = tp * pp * dp // 8
    cluster = parse_compact(f"a100-80gb:8x{nodes}")
    node = cluster.node_types[0]
    if gemm_eff is not None:
        node = replace(node, gpu=replace(node.gpu, gemm_eff=gemm_eff))
    placement = (node,) * nodes
    dims = ParallelDims(dp=dp, tp=tp, pp=pp)
    cm = CostModel(m, a)
    cfg = PlanConfig(dims, r["mbs"], r["v"], recompute=r["recompute"] == "full", dp_overlap=r["dp_overlap"],
                     sp=r["sequence_parallel"], selective=r["recompute"] == "selective")
    ctx = PlanContext(cm, stage_envs(placement, dims, cm.a), cfg)
    res = ctx.result(ctx.partition("balanced", respect_memory=False), "balanced", placement)
    return {"predicted_s": res.iteration_s, "fits": res.feasible,
            "breakdown_s": {k: round(x, 4) for k, x in res.breakdown.items()},
            "max_memory_gib": round(max(res.stage_memory) / 2**30, 2)}


def summary(rs: list[dict]) -> dict:
    errs = [r["error"] for r in rs if r.get("error") is not None]
    if not errs:
        return {"rows": 0}
    return {"rows": len(errs), "mean_abs_error": sum(abs(e) for e in errs) / len(errs),
            "max_abs_error": max(abs(e) for e in errs), "mean_signed_error": sum(errs) / len(errs),
            "not_fitting": sum(1 for r in rs if r.get("fits") is False)}


FITTED = ("chunk_overhead_s", "dp_jitter", "gemm_half_dim")  # with the A100's gemm_eff
GRID = {"gemm_eff": [0.80, 0.82, 0.84, 0.85, 0.86, 0.87, 0.88, 0.90],  # the A100's asymptote (hardware.py)
        "chunk_overhead_s": [0, 5e-4, 1e-3, 1.25e-3, 1.5e-3, 1.75e-3, 2e-3, 3e-3],
        "dp_jitter": [0, 0.01, 0.02, 0.025, 0.03, 0.035, 0.04, 0.045, 0.05, 0.06],
        "gemm_half_dim": [32, 48, 64, 96, 128, 160, 192, 256]}


def fit() -> Assumptions:
    """Least squares over the calibration rows only, on the full grid of the fitted constants.
    Prints the result; the defaults in costs.Assumptions are set from it by hand."""
    cal = [r for r in rows() if r["set"] == CAL and expressible(r) is None]

    def loss(a: Assumptions, eff: float) -> float:
        return sum((predict(r, a, eff)["predicted_s"] / r["published_s"] - 1) ** 2 for r in cal) / len(cal)

    a, eff, best = DEFAULT, None, math.inf
    for e, *values in itertools.product(GRID["gemm_eff"], *(GRID[k] for k in FITTED)):
        cand = replace(DEFAULT, **dict(zip(FITTED, values)))
        got = loss(cand, e)
        if got < best:
            a, eff, best = cand, e, got
    print("fitted on", len(cal), "calibration rows: a100 gemm_eff", eff, {k: getattr(a, k) for k in FITTED},
          f"rms error {best ** 0.5:.2%}")
    return a


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="fit the fitted constants on the calibration rows")
    ap.add_argument("--reference-src", help="another copy of src/ whose predictions are recorded in the same run")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "plan_validate_megatron.json"))
    ap.add_argument("--src", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fit:
        fit()
        return 0
    rs = rows()
    for r in rs:
        why = expressible(r)
        if why:
            r.update(predicted_s=None, error=None, fits=None)
            r["notes"].append("not estimated: " + why)
            continue
        r.update(predict(r))
        r["error"] = r["predicted_s"] / r["published_s"] - 1
    for r in rs:
        pred = f"predicted {r['predicted_s']:7.2f} s ({r['error']:+6.1%})" if r["error"] is not None else "not expressible"
        flag = "" if r["fits"] in (True, None) else "  DOES NOT FIT"
        print(f"{r['set'][:5]:5s} {r['source'][:30]:30s} {r['model']:>7s} tp={r['tp']} pp={r['pp']:2d} dp={r['dp']:3d} "
              f"mbs={r['mbs']:2d} v={r['v']}: published {r['published_s']:7.2f} s, {pred}{flag}")
    sets = {name: summary([r for r in rs if r["set"] == name]) for name in (CAL, HELD)}
    ref_sets = None
    if args.reference_src:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "ref.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--src", args.reference_src, "--out", out],
                           check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                ref = json.load(f)
        for r, x in zip(rs, ref["rows"]):
            r["reference_predicted_s"] = x["predicted_s"]
        ref_sets = {CAL: ref["calibration"], HELD: ref["held_out"]}
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "split": {CAL: sorted({f"{r['source'].split(',')[0]} {r['model']}" for r in rs if r["set"] == CAL}),
                     HELD: sorted({f"{r['source'].split(',')[0]} {r['model']}" for r in rs if r["set"] == HELD})},
           "fitted_constants": {"a100 gemm_eff": GPU_TYPES["a100-80gb"].gemm_eff,
                                 **{k: getattr(DEFAULT, k) for k in FITTED}},
           "calibration": sets[CAL], "held_out": sets[HELD], "rows": rs}
    if ref_sets:
        out.update(reference=args.reference_src, reference_calibration=ref_sets[CAL], reference_held_out=ref_sets[HELD])
    path = args.out
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    for name, s in sets.items():
        if s["rows"]:
            print(f"{name}: {s['rows']} rows, mean |error| {s['mean_abs_error']:.1%}, max {s['max_abs_error']:.1%}, "
                  f"mean signed {s['mean_signed_error']:+.1%}, not fitting {s['not_fitting']}")
            if ref_sets:
                q = ref_sets[name]
                print(f"  reference, same run: mean |error| {q['mean_abs_error']:.1%}, max {q['max_abs_error']:.1%}, "
                      f"mean signed {q['mean_signed_error']:+.1%}, not fitting {q['not_fitting']}")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
