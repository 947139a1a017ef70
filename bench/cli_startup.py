"""Time how long ``computron --help``, ``computron ps --help`` and ``computron plan search --help`` take.

Each command runs as a fresh subprocess, pinned to one core (``taskset -c 0`` when available),
after one untimed warm-up run, ``--runs`` times; so does the reference ``python -c pass`` of the
same interpreter. Python's bytecode cache is on, as in a normal install: the children run without
``PYTHONDONTWRITEBYTECODE`` and with ``PYTHONPYCACHEPREFIX`` set to a temporary directory, which
the warm-up run fills. Writes the medians, minima and maxima to bench/results/cli_startup.json
and prints a table last.

    python bench/cli_startup.py [--runs 7] [--out bench/results/cli_startup.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 0.5
COMMANDS = ("--help", "ps --help", "plan search --help")


def _computron() -> list[str]:
    script = Path(sys.executable).parent / "computron"
    return [str(script)] if script.exists() else [sys.executable, "-m", "computron.cli"]


def _time(argv: list[str], runs: int, env: dict) -> list[float]:
    subprocess.run(argv, stdout=subprocess.DEVNULL, check=True, env=env)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, check=True, env=env)
        times.append(time.perf_counter() - t0)
    return times


def _machine() -> dict:
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0]}
    try:
        from computron.bench.common import machine

        info |= machine()
    except ImportError:
        pass
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cli_startup.json"))
    args = ap.parse_args()
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    cases = {"python -c pass": [sys.executable, "-c", "pass"]}
    cases |= {f"computron {c}": _computron() + c.split() for c in COMMANDS}
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PYTHONPYCACHEPREFIX": cache}
        for name, argv in cases.items():
            times = _time(pin + argv, args.runs, env)
            results[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                             "times_s": times}
    out = {
        "benchmark": "CLI start-up (wall time of a subprocess, one untimed warm-up run each)",
        "pinned": " ".join(pin) or None, "bytecode_cache": True, "runs": args.runs, "target_s": TARGET_S,
        "reference": "python -c pass", "commands": results,
        "meets_target": all(r["median_s"] < TARGET_S for n, r in results.items() if n.startswith("computron")),
        "machine": _machine(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    print(f"{'command':<30} {'median s':>9} {'min s':>7} {'max s':>7}   "
          f"({args.runs} runs, {out['pinned'] or 'not pinned'})")
    for name, r in results.items():
        print(f"{name:<30} {r['median_s']:>9.3f} {r['min_s']:>7.3f} {r['max_s']:>7.3f}")
    return 0 if out["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
