"""The hot/cold mix measured on the server (``bench/gpu_slo.sh``), every run found under the given
folders, as one Markdown table and one chart of SLO attainment against the total rate.

A run is ``.../rate_<R>/measured_<policy>.json`` (loadgen's output); the models a step it ran with is
read from a ``mps<N>`` folder above it (``MPS=N bash bench/gpu_slo.sh`` with ``OUT=.../mps<N>``), 1
when there is none. Per run: the attainment at ``--scale`` times each model's solo latency (the
curve loadgen wrote), requests refused or failed, mean and p99 latency, and the longest time to
first token of any request to a model other than ``--hot`` (the wait the issue bounds). The rate at
which each (policy, models a step) holds ``--target`` attainment is interpolated between the two
measured rates around it. ``--sim FILE`` (a ``computron sim --sweep rate`` JSON) adds its curves,
dashed, labelled with ``--sim-label``.

    python3 bench/preempt_gpu_report.py bench/results/preempt_gpu_h200 bench/results/preempt_gpu_h200_mps3 \\
        --plot bench/results/preempt_gpu_h200_mps3/attainment_rate.png
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def _mps(path: Path) -> int:
    for part in reversed(path.parts):
        m = re.fullmatch(r"mps(\d+)", part)
        if m:
            return int(m.group(1))
    return 1


def runs(roots: list[Path], scale: float, hot: str) -> list[dict]:
    out = []
    for root in roots:
        for f in sorted(root.rglob("rate_*/measured_*.json")):
            rate = float(f.parent.name.removeprefix("rate_"))
            policy = f.stem.removeprefix("measured_")
            d = json.loads(f.read_text())
            s, slo = d["summary"], d["summary"]["slo"]
            if scale not in slo["scales"]:
                raise SystemExit(f"{f}: no attainment at {scale}x (has {slo['scales']})")
            cold = [r["first_token"] - r["arrival"] for r in d["records"]
                    if r["model"] != hot and r.get("first_token") is not None]
            out.append({"rate": rate, "policy": policy, "mps": _mps(f), "path": str(f),
                        "attained": slo["all"][slo["scales"].index(scale)],
                        "requests": s["all"]["requests"], "failed": s["all"]["failed"],
                        "mean_s": s["all"]["latency"]["mean"], "p99_s": s["all"]["latency"]["p99"],
                        "cold_ttft_max_s": max(cold) if cold else float("nan")})
    return sorted(out, key=lambda r: (r["policy"], r["mps"], r["rate"]))


def rate_at(points: list[tuple[float, float]], target: float) -> str:
    """The rate where attainment falls through ``target``, interpolated; ``>R`` or ``<R`` when every
    measured rate is on one side."""
    points = sorted(points)
    for (r0, a0), (r1, a1) in zip(points, points[1:]):
        if a0 >= target > a1:
            return f"{r0 + (r1 - r0) * (a0 - target) / (a0 - a1):.1f}"
    if points and all(a >= target for _, a in points):
        return f">{points[-1][0]:g}"
    return f"<{points[0][0]:g}" if points else "-"


def curves(rs: list[dict]) -> dict[tuple[str, int], list[tuple[float, float]]]:
    out: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in rs:
        out.setdefault((r["policy"], r["mps"]), []).append((r["rate"], r["attained"]))
    return out


def sim_curves(path: Path) -> dict[str, list[tuple[float, float]]]:
    d = json.loads(path.read_text())
    out: dict[str, list[tuple[float, float]]] = {}
    for run in d["runs"]:
        slo = run["summary"]["slo"]
        out.setdefault(run["policy"], []).append((float(run["rate"]), slo["all"][slo["scales"].index(5)]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("roots", nargs="+", type=Path)
    ap.add_argument("--scale", type=float, default=5.0, help="SLO as this many times the solo latency")
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--hot", default="hot", help="the hot model (its requests are left out of the cold wait)")
    ap.add_argument("--sim", type=Path, nargs="*", default=[])
    ap.add_argument("--sim-label", nargs="*", default=[])
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    rs = runs(args.roots, args.scale, args.hot)
    if not rs:
        print(f"no rate_*/measured_*.json under {', '.join(map(str, args.roots))}", file=sys.stderr)
        return 2
    print(f"| policy | models a step | rate (req/s) | requests | refused or failed | attained at {args.scale:g}x "
          "| latency mean / p99 (s) | longest cold TTFT (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rs:
        print(f"| {r['policy']} | {r['mps']} | {r['rate']:g} | {r['requests']} | {r['failed']} | "
              f"{r['attained'] * 100:.1f}% | {r['mean_s']:.2f} / {r['p99_s']:.2f} | {r['cold_ttft_max_s']:.2f} |")
    print()
    for (policy, mps), pts in curves(rs).items():
        print(f"{policy}, {mps} a step: {args.target * 100:g}% held to {rate_at(pts, args.target)} req/s")
    if args.plot:
        from computron.workload.report import _pyplot

        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for (policy, mps), pts in curves(rs).items():
            ax.plot(*zip(*sorted(pts)), marker="o", label=f"measured: {policy}, {mps} model(s) a step")
        for i, f in enumerate(args.sim):
            label = args.sim_label[i] if i < len(args.sim_label) else f.stem
            for policy, pts in sim_curves(f).items():
                ax.plot(*zip(*sorted(pts)), ls="--", alpha=0.6, label=f"simulated: {policy}, {label}")
        ax.axhline(args.target, color="grey", lw=0.8)
        ax.set_xlabel("total rate (requests/s)")
        ax.set_ylabel(f"SLO attainment at {args.scale:g}x solo latency")
        ax.set_ylim(0.8, 1.005)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
