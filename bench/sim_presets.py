"""The original Computron simulation's presets in the simulator, both policies: what
``bench/gpu_sim_presets.sh`` will measure on a GPU, predicted from a calibration of that GPU.

Every preset (``computron sim --help``: 3 models with 2 resident, 6 with 4, at the named rates) at
each ``--cv``, ``--duration`` seconds of Gamma arrivals, prompts and outputs of 128 tokens, seed 1
(the traces ``bench/gpu_sim_presets.sh`` replays), simulated with the default policy from
``--calibration`` and with the ``computron`` policy from ``--calibration-computron`` (its executor's,
as ``bench/gpu_sim_validate.sh`` makes them). Prints a Markdown table of mean and p99 latency and the
factor by which the default policy's are lower (the issue's target: 3x or more for both), and writes
every run's summary to ``--out``.

    PYTHONPATH=src python3 bench/sim_presets.py [--models opt-1.3b] [--cv 0.25 1 4]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from computron.cli import main as cli
from computron.sim.cli import PRESETS


def simulate(preset: str, shape: str, cv: float, duration: float, policy: str, calibration: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/sim.json"
        argv = ["sim", "--preset", preset, "--models", shape, "--cv", str(cv), "--duration", str(duration),
                "--prompt", "128", "--output", "128", "--seed", "1", "--policy", policy,
                "--calibration", calibration, "--out", out]
        with contextlib.redirect_stdout(io.StringIO()):
            code = cli(argv)
        if code:
            raise SystemExit(f"computron {' '.join(argv)} failed ({code})")
        return json.loads(Path(out).read_text())["summary"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="opt-1.3b", help="the model every preset copies")
    ap.add_argument("--cv", type=float, nargs="+", default=[0.25, 1.0, 4.0])
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--calibration", default="bench/results/sim_validate/calibration_gpu.json")
    ap.add_argument("--calibration-computron", default="bench/results/sim_validate/calibration_gpu_legacy.json")
    ap.add_argument("--out", default="bench/results/sim_presets.json")
    args = ap.parse_args(argv)
    from computron.bench.common import write_json

    runs, lines = [], []
    for preset in PRESETS:
        for cv in args.cv:
            got = {p: simulate(preset, args.models, cv, args.duration, p, cal)
                   for p, cal in (("default", args.calibration), ("computron", args.calibration_computron))}
            runs.append({"preset": preset, "cv": cv, "summaries": got})
            d, c = (got[p]["all"]["latency"] for p in ("default", "computron"))
            lines.append(f"| {preset} | {cv:g} | {got['default']['all']['requests']} | {d['mean'] * 1e3:,.0f} / "
                         f"{d['p99'] * 1e3:,.0f} | {c['mean'] * 1e3:,.0f} / {c['p99'] * 1e3:,.0f} | "
                         f"{c['mean'] / d['mean']:.1f}x / {c['p99'] / d['p99']:.1f}x |")
    write_json(args.out, {"settings": vars(args), "runs": runs})
    print("| preset | CV | requests | default mean / p99 ms | computron mean / p99 ms | computron over default |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
