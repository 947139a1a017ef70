"""The simulator against the server, by which calibration it is given: is its error the model's, or
the calibration's?

ROOT holds one folder per call on a lent GPU (``call*/``): the served calibration that call measured
first (``calibration_served.json``, ``bench calibrate --serve``) and the hot/cold runs it measured
after (``bench/gpu_slo_seeds.sh``: ``seed*/mps*/rate_*/measured_<policy>.json`` beside ``trace.jsonl``).
Every run is simulated as ``bench/preempt_gpu_report.py --simulate`` does (the server's models,
budget, policy and models a step; loadgen's probes first) from its own call's calibration, from each
other call's, and from each ``--also`` calibration (one measured on another lease). Then, for the
first ``--also``, the same with one group of its terms at a time taken from the run's own call's
calibration (decode steps, prefills, swaps and evictions, graph captures, shared steps): the group
that closes the gap is where the calibrations differ. Prints Markdown tables and writes ``--out``.

    python3 bench/calibration_drift.py bench/results/step_residual_h200 \\
        --also bench/results/preempt_gpu_h200_seeds/calibration_served_f036_warmup.json \\
        --out bench/results/step_residual_h200/drift.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from preempt_gpu_report import _mps  # noqa: E402

MODELS = ",".join(f"opt-1.3b={n}" for n in ("hot", "c1", "c2", "c3", "c4", "c5"))  # bench/gpu_slo.sh's server
GROUPS = {  # the calibration's terms, by what they time
    "decode": ("decode_fixed_s", "decode_seq_s", "decode_seq_s_per_byte", "decode_fixed_s_per_byte"),
    "prefill": ("prefill_fixed_s", "prefill_token_s", "prefill_token_s_per_byte", "prefill_fixed_s_per_byte"),
    "swap": ("swap_bandwidth", "hbm_bandwidth", "evict_s", "evict_s_per_byte"),
    "graphs": ("graph_capture_s", "graph_capture_s_per_byte", "graph_warmup_s", "graph_warmup_s_per_byte"),
    "shared": ("concurrent_step_fraction",),
}
QUANTILES = ("mean", "p50", "p99")


def calls(root: Path) -> list[dict]:
    """Each call folder under ``root``: its calibration and its runs (policy, models a step, paths)."""
    out = []
    for d in sorted(p for p in root.glob("call*") if p.is_dir()):
        cal = d / "calibration_served.json"
        if not cal.is_file():
            raise SystemExit(f"{d}: no calibration_served.json (each call measures its own first)")
        found = [{"policy": f.stem.removeprefix("measured_"), "mps": _mps(f), "measured": f,
                  "trace": f.parent / "trace.jsonl", "name": "/".join(f.relative_to(root).parts[:-1])}
                 for f in sorted(d.rglob("rate_*/measured_*.json"))]
        legacy = [r["name"] for r in found if r["policy"] == "computron"]
        if legacy:  # its executor has costs of its own (bench calibrate --executor legacy)
            raise SystemExit(f"{', '.join(legacy)}: the computron policy's runs need a calibration of its executor, "
                             "which a served calibration is not; leave them out of ROOT")
        out.append({"call": d.name, "calibration": cal, "runs": found})
    if not out:
        raise SystemExit(f"no call*/ folders under {root}")
    return out


def latency(summary: dict) -> dict[str, float]:
    return {q: summary["all"]["latency"][q] for q in QUANTILES}


def simulate(run: dict, cal: Path, args) -> dict[str, float]:
    """The run's trace simulated from ``cal`` as the report does: mean, p50 and p99 latency (seconds)."""
    from computron.cli import main as cli

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sim.json"
        flags = ["sim", "--models", args.models, "--trace", str(run["trace"]), "--calibration", str(cal),
                 "--policy", run["policy"], "--models-per-step", str(run["mps"]), "--budget", args.budget,
                 "--max-loaded", str(args.max_loaded), "--loadgen-probes", "--out", str(out)]
        if cli(flags) != 0:
            raise SystemExit(f"computron {' '.join(flags)} failed")
        return latency(json.loads(out.read_text())["summary"])


def mixed(base: Path, own: Path, group: str, where: Path) -> Path:
    """``base``'s calibration with ``group``'s terms from ``own``, written to ``where``."""
    b, o = json.loads(base.read_text()), json.loads(own.read_text())
    for k in GROUPS[group]:
        if k in o:
            b[k] = o[k]
        else:
            b.pop(k, None)
    b["name"] = f"{b.get('name', base.stem)} with {group} from {own.parent.name}"
    where.write_text(json.dumps(b, indent=2) + "\n")
    return where


def errors(sim: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
    return {q: sim[q] / measured[q] - 1 for q in QUANTILES}


def decode_ms(cal: Path, model: str, batch: int) -> float:
    """One decode step of ``model`` at ``batch`` sequences, by the calibration (ms)."""
    from computron.config import EngineConfig
    from computron.sim.costs import calibration
    from computron.sim.run import Simulation

    c = calibration(str(cal))
    sim = Simulation([model], c, EngineConfig(device="cpu"))
    return 1e3 * c.decode_time(next(iter(sim.executor.models.values())).nbytes, batch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--also", type=Path, action="append", default=[], metavar="CAL",
                    help="a calibration from elsewhere to simulate every run from too (repeatable); the first "
                         "is taken apart group by group")
    ap.add_argument("--models", default=MODELS, help="the server's models (bench/gpu_slo.sh's)")
    ap.add_argument("--budget", default="10.5GiB")
    ap.add_argument("--max-loaded", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cs = calls(args.root)
    cals = {c["call"]: c["calibration"] for c in cs} | {p.stem: p for p in args.also}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for c in cs:
            for run in c["runs"]:
                measured = latency(json.loads(run["measured"].read_text())["summary"])
                row = {"run": run["name"], "policy": run["policy"], "mps": run["mps"], "call": c["call"],
                       "measured_s": measured, "by_calibration": {}, "first_also_with_own": {}}
                for name, cal in cals.items():
                    row["by_calibration"][name] = errors(simulate(run, cal, args), measured)
                if args.also:
                    for g in GROUPS:
                        cal = mixed(args.also[0], c["calibration"], g, Path(tmp) / f"{g}.json")
                        row["first_also_with_own"][g] = errors(simulate(run, cal, args), measured)
                rows.append(row)
    pct = lambda e: " / ".join(f"{100 * e[q]:+.1f}%" for q in QUANTILES)  # noqa: E731
    print("Simulated minus measured latency (mean / p50 / p99), by the calibration simulated from:\n")
    print("| run | policy, models a step | " + " | ".join(cals) + " |")
    print("| --- | --- |" + " --- |" * len(cals))
    for r in rows:
        cells = [pct(r["by_calibration"][n]) + (" (own)" if n == r["call"] else "") for n in cals]
        print(f"| {r['run']} | {r['policy']}, {r['mps']} | " + " | ".join(cells) + " |")
    own = [abs(r["by_calibration"][r["call"]][q]) for r in rows for q in QUANTILES]
    other = [abs(e[q]) for r in rows for n, e in r["by_calibration"].items() if n in {c["call"] for c in cs}
             and n != r["call"] for q in QUANTILES]
    summary = {"own_call_mean_abs": statistics.fmean(own), "own_call_worst_abs": max(own)}
    if other:
        summary |= {"other_call_mean_abs": statistics.fmean(other), "other_call_worst_abs": max(other)}
    for p in args.also:
        e = [abs(r["by_calibration"][p.stem][q]) for r in rows for q in QUANTILES]
        summary[f"{p.stem}_mean_abs"], summary[f"{p.stem}_worst_abs"] = statistics.fmean(e), max(e)
    print("\n" + ", ".join(f"{k} {100 * v:.1f}%" for k, v in summary.items()))
    if args.also:
        print(f"\n{args.also[0].stem} with one group of terms from the run's own call (mean / p50 / p99):\n")
        print("| run | " + " | ".join(GROUPS) + " |\n| --- |" + " --- |" * len(GROUPS))
        for r in rows:
            print(f"| {r['run']} | " + " | ".join(pct(r["first_also_with_own"][g]) for g in GROUPS) + " |")
    model = args.models.split(",")[0]
    steps = {n: {b: decode_ms(cal, model, b) for b in (1, 8, 32)} for n, cal in cals.items()}
    print(f"\nA decode step of {model.split('=')[0]} by each calibration (ms, batch 1 / 8 / 32): "
          + "; ".join(f"{n} " + " / ".join(f"{v:.2f}" for v in s.values()) for n, s in steps.items()))
    if args.out:
        args.out.write_text(json.dumps({"root": str(args.root), "calibrations": {n: str(p) for n, p in cals.items()},
                                        "rows": rows, "summary": summary, "decode_ms": steps}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
