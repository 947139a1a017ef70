"""The hot/cold mix of issue 12, simulated over several traces: where each policy stops meeting the SLO
(5x solo latency) for 99% of requests, with every seed's requests pooled at each rate.

One trace is a poor judge of a 99% point: at 60 s and 4 req/s, 1% is two requests, and each seed's
curve crosses 99% somewhere else. This runs `computron sim --sweep rate` for each seed (in parallel
processes), pools the requests that met the SLO over the seeds at each rate, and interpolates the
rate where the pooled attainment falls under 99%, for the default policy at one model a step and the
slo policy at three. ``--start arrival`` makes the traces as they were made before 2026-11-29, each
model's stream opening with an arrival at 0 (with CV 2, a burst on every model at once).

    PYTHONPATH=src python bench/slo_seeds.py [--seeds 1-8] [--duration 200] [--start stationary|arrival]
        [--calibration bench/results/preempt_gpu_h200_mps3/calibration_served_f036.json] [--out FILE]
    PYTHONPATH=src python bench/slo_seeds.py --load FILE [FILE ...] [--out FILE]

How far the ratio of the two could move with other traces: ``--bootstrap N`` (2000 by default) draws
the seeds with replacement N times, pools each draw, and gives the ratio's 5th, 50th and 95th
percentiles and how often it is 2x or more. ``--load`` pools the seeds of several files it wrote (runs
of other seeds with the same settings) without simulating again.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from preempt_gpu_report import crossing  # noqa: E402  (where attainment falls under 99%)

MODELS = ",".join(f"opt-1.3b={n}" for n in ("hot", "c1", "c2", "c3", "c4", "c5"))
CONFIGS = (("default", 1), ("slo", 3))  # (policy, models a step): today's default, and the slo policy's best


def seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def sweep(seed: int, policy: str, mps: int, args, cal: str, tmp: str) -> dict:
    out = os.path.join(tmp, f"s{seed}_{policy}_{mps}.json")
    cmd = [sys.executable, "-m", "computron.cli", "sim", "--models", MODELS, "--rates", "10,1,1,1,1,1",
           "--cv", "2", "--duration", str(args.duration), "--seed", str(seed), "--prompt", "32:512",
           "--output", "16:256", "--budget", "10.5GiB", "--max-loaded", "3", "--calibration", cal,
           "--models-per-step", str(mps), "--sweep", "rate", "--values", args.rates, "--policies", policy,
           "--start", args.start, "--out", out]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"slo_seeds.py: computron sim failed for seed {seed}, {policy} ({done.returncode}):\n"
                         f"{done.stderr[-2000:]}")
    return json.loads(Path(out).read_text())


Cells = dict[str, dict[float, dict[int, tuple[int, int]]]]  # config -> rate -> seed -> (met, requests)


def cells_of(todo, results) -> Cells:
    cells: Cells = {}
    for (seed, policy, mps), res in zip(todo, results):
        for run in res["runs"]:
            s = run["summary"]
            n, a = s["all"]["requests"], s["slo"]["all"][s["slo"]["scales"].index(5)]
            cells.setdefault(f"{policy}@{mps}", {}).setdefault(float(run["rate"]), {})[seed] = (round(a * n), n)
    return cells


def load(paths: list[str]) -> tuple[Cells, dict]:
    """The cells of files this script wrote, merged: traces of the same length, start and calibration,
    each seed in one file only."""
    cells: Cells = {}
    settings = None
    for path in paths:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"slo_seeds.py: cannot read {path}: {e}") from None
        if not isinstance(d, dict) or "settings" not in d or "configs" not in d:
            raise SystemExit(f"slo_seeds.py: {path} is not a file this script wrote (no settings and configs)")
        same = {k: d["settings"][k] for k in ("duration", "start", "calibration", "rates")}
        if settings is not None and same != {k: settings[k] for k in same}:
            raise SystemExit(f"slo_seeds.py: {path} was simulated with other settings: {same} against {settings}")
        settings = settings or dict(d["settings"])
        for name, c in d["configs"].items():
            for rate, v in c["pooled"].items():
                if "met_by_seed" not in v:
                    raise SystemExit(f"slo_seeds.py: {path} has no count by seed (written before they were kept)")
                got = cells.setdefault(name, {}).setdefault(float(rate), {})
                for seed, met in v["met_by_seed"].items():
                    if int(seed) in got:
                        raise SystemExit(f"slo_seeds.py: seed {seed} is in two files")
                    got[int(seed)] = (met, v["requests_by_seed"][seed])
    assert settings is not None
    settings["seeds"] = ",".join(str(s) for s in sorted({s for c in cells.values() for r in c.values() for s in r}))
    return cells, settings


def points(rates: dict[float, dict[int, tuple[int, int]]], chosen: list[int]) -> list[tuple[float, float]]:
    """(rate, attainment) with the requests of the ``chosen`` seeds pooled (a seed chosen twice counts twice)."""
    return [(r, sum(by[s][0] for s in chosen) / sum(by[s][1] for s in chosen)) for r, by in sorted(rates.items())]


def ratio(cells: Cells, chosen: list[int]) -> float:
    """The slo policy's pooled 99% rate over the default's; inf when the slo policy never falls under 99%
    or the default is under it already at the lowest rate."""
    base, new = (crossing(points(cells[f"{p}@{m}"], chosen)) for p, m in CONFIGS)
    return float("inf") if not base or new is None or new == float("inf") else new / base


def bootstrap(cells: Cells, all_seeds: list[int], resamples: int, seed: int = 0) -> dict:
    """The ratio's spread over the traces: seeds drawn with replacement, ``resamples`` times."""
    rng = random.Random(seed)
    got = sorted(ratio(cells, [rng.choice(all_seeds) for _ in all_seeds]) for _ in range(resamples))
    q = lambda f: got[min(len(got) - 1, int(f * len(got)))]  # noqa: E731
    return {"resamples": resamples, "p5": q(0.05), "p50": q(0.5), "p95": q(0.95),
            "share_at_least_2x": sum(r >= 2 for r in got) / len(got)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1-8", help="LO-HI (default 1-8)")
    ap.add_argument("--duration", type=float, default=200.0)
    ap.add_argument("--rates", default="3,4,5,6,7,8,9,10,11,12")
    ap.add_argument("--start", choices=("stationary", "arrival"), default="stationary")
    ap.add_argument("--calibration", default="bench/results/preempt_gpu_h200_mps3/calibration_served_f036.json",
                    help="a calibration JSON (a relative path is taken from the repository's root) or a built-in name")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--bootstrap", type=int, default=2000, metavar="N",
                    help="resample the seeds N times for the ratio's spread (0: none)")
    ap.add_argument("--load", nargs="+", default=None, metavar="FILE",
                    help="pool the seeds of files this script wrote instead of simulating")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.bootstrap < 0:
        ap.error(f"--bootstrap takes a count of draws (0: none), got {args.bootstrap}")
    if args.load:
        cells, settings = load(args.load)
        settings["bootstrap"] = args.bootstrap
    else:
        cal = HERE.parent / args.calibration
        run_cal = str(cal) if not Path(args.calibration).is_absolute() and cal.exists() else args.calibration
        todo = [(s, p, m) for s in seeds(args.seeds) for p, m in CONFIGS]
        with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda t: sweep(*t, args, run_cal, tmp), todo))
        cells = cells_of(todo, results)
        settings = {k: v for k, v in vars(args).items() if k not in ("jobs", "load")}
    all_seeds = sorted({s for c in cells.values() for r in c.values() for s in r})
    out = {"what": "SLO attainment at 5x solo latency, pooled over seeds, hot/cold mix (issue 12), simulated",
           "settings": settings, "configs": {}}
    for name, rates in cells.items():
        pts = points(rates, all_seeds)
        per_seed = {s: crossing(points(rates, [s])) for s in all_seeds}
        pooled = {str(r): {"attained": round(a, 5), "requests": sum(n for _, n in rates[r].values()),
                           "by_seed": {s: round(m / n, 4) for s, (m, n) in rates[r].items()},
                           "met_by_seed": {s: m for s, (m, _) in rates[r].items()},
                           "requests_by_seed": {s: n for s, (_, n) in rates[r].items()}} for r, a in pts}
        out["configs"][name] = {"pooled": pooled, "rate_at_99": crossing(pts), "rate_at_99_by_seed": per_seed}
    r = ratio(cells, all_seeds)
    out["ratio_at_99"] = None if r == float("inf") else r
    for name, c in out["configs"].items():
        print(f"{name}: 99% held to {c['rate_at_99']} req/s pooled; by seed {c['rate_at_99_by_seed']}")
        print("   " + "  ".join(f"{r}: {v['attained']:.2%}" for r, v in c["pooled"].items()))
    print(f"ratio at 99%: {out['ratio_at_99']}")
    if args.bootstrap:
        b = out["bootstrap"] = bootstrap(cells, all_seeds, args.bootstrap)
        print(f"over {b['resamples']} resamples of the {len(all_seeds)} seeds: ratio 5% / 50% / 95% "
              f"{b['p5']:.2f} / {b['p50']:.2f} / {b['p95']:.2f}; at least 2x in {b['share_at_least_2x']:.0%}")
    default = f"results/preempt_gpu_h200_mps3/sim_seeds/seeds_{settings['start']}_{settings['duration']:g}s.json"
    path = Path(args.out or HERE / default)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
