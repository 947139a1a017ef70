"""Tables, CSV and JSON for plans.

What flows through: PlanResults (and Pareto points) go in; flat rows (dicts of plain values),
rich tables on a console and files on disk come out. No computation happens here.
"""

from __future__ import annotations

import csv
import json
import os

from .estimate import PlanResult
from .layout import placement_text

GIB = 1024**3


def plan_row(r: PlanResult, rank: int | None = None) -> dict:
    """One flat row per plan (CSV columns and table cells)."""
    c, b = r.config, r.breakdown
    row = {} if rank is None else {"rank": rank}
    row.update({
        "tp": c.dims.tp, "pp": c.dims.pp, "dp": c.dims.dp, "cp": c.dims.cp, "mbs": c.mbs, "virtual_stages": c.v,
        "recompute": c.recomputation, "zero": c.zero,
        "zero1": c.zero >= 1,  # what ``plan launch`` reads: it shards the optimizer state only (stage 1)
        "fp8": c.fp8, "tp_overlap": c.tp_overlap, "micro_batches": r.micro_batches,
        "placement": placement_text(r.placement), "partition": "/".join(map(str, r.partition)), "method": r.method,
        "iteration_s": round(r.iteration_s, 6), "samples_per_s": round(r.samples_per_s, 4),
        "tokens_per_s": round(r.tokens_per_s, 1),
        **{f"{k}_s": round(v, 6) for k, v in b.items()},
        "max_mem_gib": round(max(r.stage_memory) / GIB, 3),
        "mem_per_stage_gib": "/".join(f"{x / GIB:.1f}" for x in r.stage_memory),
        "usable_per_stage_gib": "/".join(f"{x / GIB:.1f}" for x in r.stage_usable),
        "stage_gpus": "/".join(r.stage_gpus), "price_per_hour": round(r.price_per_hour, 4),
        "cost_per_iteration": round(r.cost_per_iteration, 6), "usd_per_mtok": round(r.usd_per_mtok, 6),
        "model_tflops_per_gpu": round(r.model_tflops_per_gpu, 2), "mfu": round(r.mfu, 4),
        "feasible": r.feasible, "cost_source": "+".join(r.sources),
    })
    return row


def write_csv(rows: list[dict], path: str) -> None:
    _mkdir(path)
    with open(path, "w", newline="") as f:
        if not rows:
            return
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_json(obj, path: str) -> None:
    _mkdir(path)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")


def _mkdir(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)


def _fmt_s(x: float) -> str:
    """Seconds for a table cell: ``1.234``, or milliseconds as ``4.56m`` below 10 ms, ``0`` for none."""
    if x == 0:
        return "0"
    return f"{x:.3f}" if x >= 0.01 else f"{x * 1e3:.2f}m"


def plans_table(plans: list[PlanResult], title: str):
    """A rich Table of ranked plans with their breakdown."""
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    for col in ("#", "tp/pp/dp", "mbs", "v", "recomp", "zero", "placement", "layers/stage", "iter s", "samples/s",
                "compute", "bubble", "TP", "PP", "DP", "other", "max mem GiB", "$/h", "$/iter"):
        t.add_column(col, justify="left" if col in ("placement", "layers/stage") else "right")
    for i, r in enumerate(plans, 1):
        c, b = r.config, r.breakdown
        mem_i = max(range(len(r.stage_memory)), key=lambda s: r.stage_memory[s] / r.stage_usable[s])
        t.add_row(str(i), layout_text(c), str(c.mbs), str(c.v), "-" if c.recomputation == "none" else c.recomputation,
                  str(c.zero),
                  placement_text(r.placement), "/".join(map(str, r.partition)), f"{r.iteration_s:.3f}",
                  f"{r.samples_per_s:.1f}", _fmt_s(b["compute"]), _fmt_s(b["bubble"]), _fmt_s(b["tp"]),
                  _fmt_s(b["pp"]), _fmt_s(b["dp"]), _fmt_s(b["other"]),
                  f"{r.stage_memory[mem_i] / GIB:.1f}/{r.stage_usable[mem_i] / GIB:.0f}",
                  f"{r.price_per_hour:.2f}", f"{r.cost_per_iteration:.4f}")
    return t


def layout_text(c) -> str:
    """``tp/pp/dp``, then ``cp N``, ``fp8`` and ``tp-overlap`` where they apply."""
    extra = [f"cp{c.dims.cp}"] * (c.dims.cp > 1) + ["fp8"] * c.fp8 + ["tp-ovl"] * (c.tp_overlap and c.dims.tp > 1)
    return " ".join([f"{c.dims.tp}/{c.dims.pp}/{c.dims.dp}", *extra])


def stages_table(r: PlanResult):
    """Per-stage detail of one plan: GPU types, layers, op time, memory."""
    from rich.table import Table

    t = Table(title="stages")
    for col in ("stage", "GPUs", "layers", "F+B per micro-batch s", "memory GiB", "usable GiB", "capacity GiB", "fits"):
        t.add_column(col, justify="right")
    for s, (g, n, tm, mem, use, cap) in enumerate(zip(r.stage_gpus, r.partition, r.stage_time, r.stage_memory,
                                                       r.stage_usable, r.stage_capacity)):
        t.add_row(str(s), g, str(n), f"{tm:.4f}", f"{mem / GIB:.2f}", f"{use / GIB:.1f}", f"{cap / GIB:.0f}",
                  "yes" if mem <= use else "NO")
    return t


def breakdown_table(r: PlanResult):
    from rich.table import Table

    t = Table(title=f"iteration {r.iteration_s:.4f} s (critical stage breakdown)")
    t.add_column("part")
    t.add_column("seconds", justify="right")
    t.add_column("share", justify="right")
    for k, v in r.breakdown.items():
        label = f"{k} (inside compute)" if k == "recompute" else k
        t.add_row(label, f"{v:.4f}", f"{v / r.iteration_s:.1%}")
    return t
