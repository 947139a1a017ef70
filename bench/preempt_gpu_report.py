"""The hot/cold mix measured on the server (``bench/gpu_slo.sh``), every run found under the given
folders, as one Markdown table and one chart of SLO attainment against the total rate.

A run is ``.../rate_<R>/measured_<policy>.json`` (loadgen's output); the models a step it ran with is
read from a ``mps<N>`` folder above it (``MPS=N bash bench/gpu_slo.sh`` with ``OUT=.../mps<N>``), 1
when there is none. Per run: the attainment at ``--scale`` times each model's solo latency (the
curve loadgen wrote), requests refused or failed, mean and p99 latency, and the longest time to
first token of any request to a model other than ``--hot`` (the wait the issue bounds), and its folder
(under the given one, ``mps<N>`` left out: the seed's, for ``bench/gpu_slo_seeds.sh``). The rate at
which each (policy, models a step) holds ``--target`` attainment is interpolated between the two
measured rates around it (runs of one rate pooled, each weighed by its requests: the traces of several
seeds as one long trace). ``--simulate CAL`` also simulates every run on its own trace with the
calibration CAL and the server's settings, loadgen's solo-latency probes first as on the server
(``computron sim --loadgen-probes``; written beside the measurement as ``sim_<policy>.json``, reused
when one of the same calibration and settings is there), in the table and dashed on the chart in
the run's colour; the ``computron`` policy's runs with ``--simulate-legacy CAL``, a calibration of its executor
(``bench calibrate --executor legacy``), and not at all without one.

    python3 bench/preempt_gpu_report.py bench/results/preempt_gpu_h200 bench/results/preempt_gpu_h200_mps3 \\
        --simulate bench/results/preempt_gpu_h200_mps3/calibration_served_f036.json \\
        --simulate-legacy bench/results/sim_validate_h200/calibration_gpu_legacy_served.json \\
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


def _met_after(d: dict, scale: float, after: float) -> float | None:
    """Attainment at ``scale`` over the requests that arrived ``after`` seconds into the trace or later
    (the opening left out), from the records and each model's solo latency; None if there are none."""
    base = d["summary"]["slo"]["base_s"]
    late = [r for r in d["records"] if r["arrival"] >= after]
    met = [r for r in late if r["error"] is None and r.get("finish") is not None
           and r["finish"] - r["arrival"] <= scale * base[r["model"]]]
    return len(met) / len(late) if late else None


def _late(d: dict, after: float) -> int:
    return sum(r["arrival"] >= after for r in d["records"])


def runs(roots: list[Path], scale: float, hot: str, after: float = 5.0) -> list[dict]:
    out = []
    for root in roots:
        for f in sorted(root.rglob("rate_*/measured_*.json")):
            rate = float(f.parent.name.removeprefix("rate_"))
            policy = f.stem.removeprefix("measured_")
            d = json.loads(f.read_text())
            s = d["summary"]
            if scale not in s["slo"]["scales"]:
                raise SystemExit(f"{f}: no attainment at {scale}x (has {s['slo']['scales']})")
            cold = [r["first_token"] - r["arrival"] for r in d["records"]
                    if r["model"] != hot and r.get("first_token") is not None]
            where = [p for p in f.parent.relative_to(root).parts[:-1] if not re.fullmatch(r"mps\d+", p)]
            out.append({"rate": rate, "policy": policy, "mps": _mps(f), "path": str(f), "where": "/".join(where) or "-",
                        "trace": f.parent / "trace.jsonl",
                        "attained": _attained(s, scale), "attained_after": _met_after(d, scale, after),
                        "late": _late(d, after), "requests": s["all"]["requests"], "failed": s["all"]["failed"],
                        "mean_s": s["all"]["latency"]["mean"], "p99_s": s["all"]["latency"]["p99"],
                        "cold_ttft_max_s": max(cold) if cold else float("nan")})
    return sorted(out, key=lambda r: (r["policy"], r["mps"], r["rate"]))


def _attained(summary: dict, scale: float) -> float:
    slo = summary["slo"]
    return slo["all"][slo["scales"].index(scale)]


def simulate(r: dict, args) -> dict | None:
    """The run simulated on its trace: attainment, mean and p99 latency (None when the trace was not kept, or for the
    ``computron`` policy without ``--simulate-legacy``: its executor's costs are not in a calibration
    of the default one)."""
    cal = args.simulate_legacy if r["policy"] == "computron" else args.simulate
    out = Path(r["path"]).with_name(f"sim_{r['policy']}.json")
    want = {"calibration": str(cal), "models_per_step": r["mps"], "budget": args.budget,
            "max_loaded": args.max_loaded, "models": args.models, "loadgen_probes": True}
    if not out.exists() or {k: json.loads(out.read_text())["settings"].get(k) for k in want} != want:
        if not r["trace"].exists() or cal is None:
            return None
        from computron.cli import main as cli

        flags = ["sim", "--models", args.models, "--trace", str(r["trace"]), "--calibration", str(cal),
                 "--policy", r["policy"], "--models-per-step", str(r["mps"]), "--budget", args.budget,
                 "--max-loaded", str(args.max_loaded), "--slo-scale", f"{args.scale:g}", "--loadgen-probes",
                 "--out", str(out)]
        if cli(flags) != 0:
            raise SystemExit(f"computron {' '.join(flags)} failed")
    d = json.loads(out.read_text())
    s = d["summary"]
    return {"attained": _attained(s, args.scale), "mean_s": s["all"]["latency"]["mean"],
            "p99_s": s["all"]["latency"]["p99"],
            "pairs": twins(json.loads(Path(r["path"]).read_text())["records"], d["records"])}


def twins(measured: list[dict], simulated: list[dict], slack: float = 0.05) -> list[tuple[dict, dict]]:
    """Each finished measured request with its simulated twin: the one of its model, prompt and output
    lengths that arrived within ``slack`` seconds (loadgen sends a little after the trace's time).
    Requests without exactly one such twin, or unfinished in either, are left out."""
    by_kind: dict[tuple, list[dict]] = {}
    for q in simulated:
        by_kind.setdefault((q["model"], q["prompt_tokens"], q["output_tokens"]), []).append(q)
    out = []
    for r in measured:
        near = [q for q in by_kind.get((r["model"], r["prompt_tokens"], r["output_tokens"]), [])
                if abs(q["arrival"] - r["arrival"]) < slack]
        if len(near) == 1 and all(x.get("first_token") is not None and x.get("finish") is not None
                                  for x in (r, near[0])):
            out.append((r, near[0]))
    return out


def phase_gaps(pairs: list[tuple[dict, dict]]) -> tuple[float, float] | None:
    """Where the simulated latency falls short: the mean over ``twins`` of measured minus simulated time
    to first token, and of the same for the rest (first token to last), in seconds; None without any."""
    if not pairs:
        return None
    first = [(r["first_token"] - r["arrival"]) - (q["first_token"] - q["arrival"]) for r, q in pairs]
    rest = [(r["finish"] - r["first_token"]) - (q["finish"] - q["first_token"]) for r, q in pairs]
    return sum(first) / len(pairs), sum(rest) / len(pairs)


CONTEXTS = (0, 150, 300, 450, 10**9)  # --by-context's bins of a request's mean context while it decodes


def gap_by_context(pairs: list[tuple[dict, dict]], least: int = 8) -> list[tuple[int, int, int, float]]:
    """Measured minus simulated seconds per output token after the first, binned by the request's mean
    context while decoding (its prompt and half its output): (low, high, requests, mean gap). A cost
    the simulator misses that grows with the context (reading each sequence's KV cache) shows as a gap
    that grows from bin to bin; one per step, as a flat gap. Requests of fewer than ``least`` output
    tokens are left out (too few tokens to divide by)."""
    bins: dict[int, list[float]] = {}
    for r, q in pairs:
        n = r["output_tokens"]
        if n < least:
            continue
        ctx = r["prompt_tokens"] + n / 2
        i = next(i for i in range(len(CONTEXTS) - 1) if ctx < CONTEXTS[i + 1])
        bins.setdefault(i, []).append(((r["finish"] - r["first_token"]) - (q["finish"] - q["first_token"])) / (n - 1))
    return [(CONTEXTS[i], CONTEXTS[i + 1], len(v), sum(v) / len(v)) for i, v in sorted(bins.items())]


def crossing(points: list[tuple[float, float]], target: float = 0.99) -> float | None:
    """The rate where attainment first falls under ``target``, linear between the measured rates around
    it; None when it is under it at the lowest rate (or there are no points), inf when never."""
    prev = None
    for rate, a in sorted(points):
        if a < target:
            if prev is None:
                return None
            r0, a0 = prev
            return r0 + (rate - r0) * (a0 - target) / (a0 - a)
        prev = (rate, a)
    return float("inf") if prev is not None else None


def rate_at(points: list[tuple[float, float]], target: float) -> str:
    """``crossing`` as text: ``>R`` or ``<R`` when every measured rate is on one side."""
    if not points:
        return "-"
    r = crossing(points, target)
    if r is None:
        return f"<{min(points)[0]:g}"
    return f">{max(points)[0]:g}" if r == float("inf") else f"{r:.1f}"


def curves(rs: list[dict], key: str = "attained") -> dict[tuple[str, int], list[tuple[float, float]]]:
    """Per (policy, models a step): (rate, ``key``) points, the runs of one rate pooled: each weighs
    by its requests (``late`` ones for ``attained_after``), so traces of several seeds count as one
    long trace, and a trace measured again is averaged."""
    weight = "late" if key == "attained_after" else "requests"
    got: dict[tuple[str, int], dict[float, list[tuple[float, int]]]] = {}
    for r in rs:
        if r.get(key) is not None:
            got.setdefault((r["policy"], r["mps"]), {}).setdefault(r["rate"], []).append((r[key], r[weight]))
    return {k: [(rate, sum(a * n for a, n in v) / sum(n for _, n in v)) for rate, v in sorted(by_rate.items())]
            for k, by_rate in got.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("roots", nargs="+", type=Path)
    ap.add_argument("--scale", type=float, default=5.0, help="SLO as this many times the solo latency")
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--after", type=float, default=5.0,
                    help="also the attainment of the requests that arrived this many seconds into the trace or later")
    ap.add_argument("--hot", default="hot", help="the hot model (its requests are left out of the cold wait)")
    ap.add_argument("--simulate", type=Path, default=None, metavar="CAL",
                    help="simulate each run with this calibration")
    ap.add_argument("--simulate-legacy", type=Path, default=None, metavar="CAL",
                    help="--simulate: the calibration of the computron policy's (legacy) executor")
    ap.add_argument("--models", default=",".join(f"opt-1.3b={n}" for n in ("hot", "c1", "c2", "c3", "c4", "c5")),
                    help="--simulate: the server's models (bench/gpu_slo.sh's)")
    ap.add_argument("--budget", default="10.5GiB", help="--simulate: the server's budget")
    ap.add_argument("--max-loaded", type=int, default=3, help="--simulate: the server's max_loaded")
    ap.add_argument("--by-context", action="store_true",
                    help="--simulate: also the measured minus simulated time per output token by context")
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.by_context and not args.simulate:
        ap.error("--by-context compares measured requests with simulated ones: give --simulate CAL")
    rs = runs(args.roots, args.scale, args.hot, args.after)
    if not rs:
        print(f"no rate_*/measured_*.json under {', '.join(map(str, args.roots))}", file=sys.stderr)
        return 2
    for r in rs:
        got = simulate(r, args) if args.simulate else None
        r["simulated"] = got and got["attained"]
        r["sim_latency"] = got and (got["mean_s"], got["p99_s"])
        r["pairs"] = got["pairs"] if got else []
        r["phases"] = phase_gaps(r["pairs"])
    sim = lambda r: "-" if r["simulated"] is None else f"{r['simulated'] * 100:.1f}%"  # noqa: E731
    err = lambda r: "-" if not r["sim_latency"] else "{:+.0f}% / {:+.0f}%".format(  # noqa: E731
        *(100 * (x / m - 1) for x, m in zip(r["sim_latency"], (r["mean_s"], r["p99_s"]))))
    print(f"| policy | models a step | rate (req/s) | requests | refused or failed | attained at {args.scale:g}x "
          f"| after {args.after:g} s | simulated | latency mean / p99 (s) | simulated latency's error, mean / p99 "
          "| measured minus simulated, first token / the rest (ms) | longest cold TTFT (s) | folder |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    gap = lambda r: "-" if not r["phases"] else "{:+.0f} / {:+.0f}".format(  # noqa: E731
        *(1e3 * x for x in r["phases"]))
    after = lambda r: "-" if r["attained_after"] is None else f"{r['attained_after'] * 100:.1f}%"  # noqa: E731
    for r in rs:
        print(f"| {r['policy']} | {r['mps']} | {r['rate']:g} | {r['requests']} | {r['failed']} | "
              f"{r['attained'] * 100:.1f}% | {after(r)} | {sim(r)} | {r['mean_s']:.2f} / {r['p99_s']:.2f} | {err(r)} "
              f"| {gap(r)} | {r['cold_ttft_max_s']:.2f} | {r['where']} |")
    print()
    simulated, opened = curves(rs, "simulated"), curves(rs, "attained_after")
    measured = curves(rs)
    groups: dict[tuple, list[dict]] = {}
    for r in rs:
        groups.setdefault((r["policy"], r["mps"], r["rate"]), []).append(r)
    if any(len(g) > 1 for g in groups.values()):
        pct = lambda x: "-" if x is None else f"{x * 100:.1f}%"  # noqa: E731
        print(f"Runs of one rate pooled:\n\n| policy | models a step | rate (req/s) | runs | requests "
              f"| attained at {args.scale:g}x | after {args.after:g} s | simulated |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for (policy, mps), pts in measured.items():
            for rate, a in pts:
                g = groups[policy, mps, rate]
                late, sim_a = (dict(c.get((policy, mps), [])).get(rate) for c in (opened, simulated))
                print(f"| {policy} | {mps} | {rate:g} | {len(g)} | {sum(r['requests'] for r in g)} | {pct(a)} "
                      f"| {pct(late)} | {pct(sim_a)} |")
        print()
    for (policy, mps), pts in measured.items():
        also = f"; simulated: {rate_at(simulated[policy, mps], args.target)}" if (policy, mps) in simulated else ""
        print(f"{policy}, {mps} a step: {args.target * 100:g}% held to {rate_at(pts, args.target)} req/s "
              f"(after {args.after:g} s: {rate_at(opened.get((policy, mps), []), args.target)}{also})")
    if args.by_context:
        print("\nMeasured minus simulated time per output token after the first, by the request's mean "
              "context while decoding (its prompt and half its output):\n\n| policy | models a step "
              "| context (tokens) | requests | gap per token (us) |\n| --- | --- | --- | --- | --- |")
        for key in sorted({(r["policy"], r["mps"]) for r in rs}):
            pairs = [p for r in rs if (r["policy"], r["mps"]) == key for p in r["pairs"]]
            for lo, hi, n, gap in gap_by_context(pairs):
                top = "" if hi >= CONTEXTS[-1] else f"{hi}"
                print(f"| {key[0]} | {key[1]} | {lo}-{top} | {n} | {gap * 1e6:+.0f} |")
    if args.plot:
        from computron.workload.report import _pyplot

        plt = _pyplot()
        low = min(r["attained"] for r in rs)
        # the whole range when some policy falls far (the computron policy), beside a close-up of the top
        panels = [(0.0, 1.02), (0.85, 1.005)] if low < 0.8 else [(0.8, 1.005)]
        fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
        for ax, (lo, hi) in zip(axes[0], panels):
            for (policy, mps), pts in measured.items():
                line, = ax.plot(*zip(*pts), marker="o", label=f"measured: {policy}, {mps} a step")
                if (policy, mps) in simulated:
                    ax.plot(*zip(*simulated[policy, mps]), ls="--", marker="x", color=line.get_color(),
                            alpha=0.7, label=f"simulated: {policy}, {mps} a step")
            ax.axhline(args.target, color="grey", lw=0.8)
            ax.set_xlabel("total rate (requests/s)")
            ax.set_ylabel(f"SLO attainment at {args.scale:g}x solo latency")
            ax.set_ylim(lo, hi)
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
