"""What the simulator says each lever buys on the hot/cold mix (six OPT-1.3B-shaped models, room for
three, `hot` 10/15 of the requests, Gamma CV 2, 300 s; bench/gpu_slo.sh's workload): SLO attainment
at 5x solo latency of today's default policy (one model a step) and of the slo policy (three a
step) at rates around their 99% points, from the H200's served calibration as measured and from
copies of it with one term changed: a prefill 3 ms cheaper (``prefill``), and a decode step 0.35 ms
cheaper with each extra model of a shared step adding 0.25 of its step instead of 0.36 (``engine``).
Two trace seeds each. Writes bench/results/preempt_gpu_h200_mps3/sim_levers/levers.json.

    PYTHONPATH=src python bench/sim_levers.py [--seeds 2 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "bench" / "results" / "preempt_gpu_h200_mps3"
CAL = HERE / "calibration_served_f036.json"
RUNS = [("default", 1, (5, 6, 7)), ("slo", 3, (10, 11, 12))]


def variants(base: dict) -> dict[str, dict]:
    prefill = {**base, "prefill_fixed_s": base["prefill_fixed_s"] - 0.003, "name": base["name"] + ", prefill -3 ms"}
    engine = {**base, "decode_fixed_s": base["decode_fixed_s"] - 0.00035, "concurrent_step_fraction": 0.25,
              "name": base["name"] + ", decode -0.35 ms, shared-step fraction 0.25"}
    return {"measured": base, "prefill": prefill, "engine": engine}


def attained(cal: str, policy: str, mps: int, rate: float, seed: int) -> float:
    r = rate / 15
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "computron.cli", "sim", "--models",
               ",".join(f"opt-1.3b={m}" for m in ("hot", "c1", "c2", "c3", "c4", "c5")),
               "--rates", ",".join(str(x) for x in [10 * r] + [r] * 5), "--duration", "300", "--cv", "2",
               "--prompt", "32:512", "--output", "16:256", "--seed", str(seed), "--slo-scale", "5",
               "--calibration", cal, "--policy", policy, "--budget", "10.5GiB", "--max-loaded", "3",
               "--models-per-step", str(mps), "--max-wait", "1.0", "--out", f"{tmp}/s.json"]
        subprocess.run(cmd, check=True, capture_output=True, env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""})
        slo = json.loads(Path(f"{tmp}/s.json").read_text())["summary"]["slo"]
        return slo["all"][slo["scales"].index(5)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--out", default=str(HERE / "sim_levers" / "levers.json"))
    a = ap.parse_args(argv)
    out = {"calibration": str(CAL.relative_to(ROOT)), "seeds": a.seeds, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cal in variants(json.loads(CAL.read_text())).items():
            path = f"{tmp}/{name}.json"
            Path(path).write_text(json.dumps(cal))
            for policy, mps, rates in RUNS:
                for rate in rates:
                    got = [attained(path, policy, mps, rate, s) for s in a.seeds]
                    out["rows"].append({"variant": name, "policy": policy, "models_per_step": mps, "rate": rate,
                                        "attained_at_5x": got})
                    print(f"{name:9s} {policy:8s} {mps} a step, {rate:3d} req/s: "
                          + " / ".join(f"{g:.1%}" for g in got), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
