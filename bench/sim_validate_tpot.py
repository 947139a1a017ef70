"""The committed H100 validation trace simulated again with a per-stream server cost (issue 11).

Calibrations (H100-measured files under results/sim_validate_h100/, never overwritten) amended by
``server_seq_s``:
- engine + cpu: the engine-only H100 calibration plus the server's per-stream cost fitted on the CPU
  (bench/server_token_cost.py: served slope minus engine slope) -- an estimate, a CPU's Python;
- served + h100 excess: the served H100 calibration plus the per-stream excess of the measured run's
  lone-model steps (B ~ 28-31, others waiting) over that calibration's step -- fitted on the run itself.

    PYTHONPATH=src python bench/sim_validate_tpot.py
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from computron.config import EngineConfig
from computron.sim import Simulation
from computron.sim.costs import Calibration, batch_time
from computron.workload import make_workload

R = Path(__file__).parent / "results"
D = R / "sim_validate_h100"
NBYTES = 2_631_516_160  # opt-1.3b fp16 weight bytes, as the simulator registers it


def run(cal: Calibration) -> dict:
    trace = make_workload(["a", "b", "c"], rate=4.0, duration=120, cv=2.0, prompt=(32, 512), output=(16, 256), seed=1)
    sim = Simulation(["opt-1.3b=a", "opt-1.3b=b", "opt-1.3b=c"], cal,
                     EngineConfig(device="cpu", policy="computron", max_loaded=2, gpu_memory_budget="8GiB"))
    s = sim.run(trace).summary()["all"]
    return {k: round(s[k]["mean"] * 1e3, 1) for k in ("latency", "ttft")} | {"tpot_p50_ms": round(s["tpot"]["p50"] * 1e3, 2)}


def main() -> None:
    eng = Calibration.load(D / "calibration_gpu_legacy.json")
    srv = Calibration.load(D / "calibration_gpu_legacy_served.json")
    cpu = json.loads((R / "server_token_cost_cpu.json").read_text())["linear_fit"]
    cpu_seq = cpu["served_step_s"]["per_stream_s"] - cpu["engine_step_s"]["per_stream_s"]
    meas = json.loads((D / "validate_measured_computron.json").read_text())
    # lone-model steps at B ~ 30 in the measured run (bench/results/sim_validate_h100: TPOT of requests whose
    # decode no other model's request shared or joined, streams 28-31.8, own waiting < 10): median 15.9 ms
    lone_b, lone_step = 30, 15.9e-3
    h100_seq = (lone_step - batch_time(srv, NBYTES, 0, lone_b)) / lone_b
    runs = {
        "served (H100, as committed)": (srv, None),
        "engine (H100, as committed)": (eng, None),
        f"engine (H100) + server_seq_s {cpu_seq * 1e6:.0f} us (CPU fit)": (replace(eng, server_seq_s=cpu_seq), "cpu"),
        f"served (H100) + server_seq_s {h100_seq * 1e6:.0f} us (H100 lone-step excess)":
            (replace(srv, server_seq_s=h100_seq), "h100-run"),
    }
    out = {"measured_h100": {"latency": round(meas["summary"]["all"]["latency"]["mean"] * 1e3, 1),
                             "ttft": round(meas["summary"]["all"]["ttft"]["mean"] * 1e3, 1),
                             "tpot_p50_ms": round(meas["summary"]["all"]["tpot"]["p50"] * 1e3, 2)},
           "cpu_server_seq_s": cpu_seq, "h100_lone_step_server_seq_s": h100_seq, "simulated": {}}
    print("measured (H100):", out["measured_h100"])
    for name, (cal, _) in runs.items():
        out["simulated"][name] = r = run(cal)
        print(f"{name}: {r}")
    (R / "sim_validate_h100_tpot.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
