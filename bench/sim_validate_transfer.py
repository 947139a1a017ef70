"""How much of the simulator's validation gap the server's own costs explain, from the committed runs.

The calibration (``bench calibrate``) times the engine alone; the validation (``gpu_sim_validate.sh``)
measures loadgen against ``serve``. This estimates what the server adds to a step from one policy's
measured run and checks it on the other policy's, held out:

1. in a run's records, a request whose decode no other model's request started or ended during
   ran alone on the device: its time per output token is one step of its model's batch. Fitted over
   those requests: step = a + b * (streams of its model, time-averaged) + c * (requests of its
   model that joined per token made): a per-step, a per-stream and a per-admission cost;
2. the same fit on the simulated run of the same trace and policy (the simulator's own model seen
   through the same lens); the measured minus the simulated terms are the server's costs;
3. those costs are added to the other policy's calibration (per step to both fixed terms, per stream
   to ``decode_seq_s``, per admission to ``prefill_fixed_s``), and the trace is simulated again.

    PYTHONPATH=src python bench/sim_validate_transfer.py [--fit-on default|computron] [--out FILE]

An estimate, not a calibration: ``bench calibrate --serve`` measures these costs directly.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from computron.config import EngineConfig
from computron.sim import Simulation
from computron.sim.costs import Calibration
from computron.sim.run import Arrival

D = Path(__file__).parent / "results" / "sim_validate"
CAL = {"default": "calibration_gpu.json", "computron": "calibration_gpu_legacy.json"}  # each policy's executor
MODELS = ["opt-1.3b=a", "opt-1.3b=b", "opt-1.3b=c"]


def step_terms(records: list[dict]) -> tuple[np.ndarray, int]:
    """(a, b, c) in seconds (see the module's docstring), and how many requests they were fitted on."""
    by_model: dict[str, list[dict]] = {}
    for r in records:
        by_model.setdefault(r["model"], []).append(r)
    events = sorted([(r["first_token"], r["model"]) for r in records] + [(r["finish"], r["model"]) for r in records])
    times = np.array([t for t, _ in events])
    rows = []
    for r in records:
        a, b, n = r["first_token"], r["finish"], r["output_tokens"]
        if n < 30:
            continue
        lo, hi = np.searchsorted(times, a, "right"), np.searchsorted(times, b, "left")
        if any(m != r["model"] for _, m in events[lo:hi]):
            continue  # another model ran meanwhile
        mine = by_model[r["model"]]
        # time-averaged streams of its model over its decode (overlap of each one's decode with it)
        streams = sum(max(0.0, min(b, q["finish"]) - max(a, q["first_token"])) for q in mine) / (b - a)
        joins = sum(1 for q in mine if a < q["first_token"] < b)
        rows.append((streams, joins / (n - 1), (b - a) / (n - 1)))
    x = np.array(rows)
    coef, *_ = np.linalg.lstsq(np.c_[np.ones(len(x)), x[:, 0], x[:, 1]], x[:, 2], rcond=None)
    return coef, len(x)


def simulate(policy: str, cal: Calibration, trace: list) -> dict:
    sim = Simulation(MODELS, cal, EngineConfig(device="cpu", policy=policy, max_loaded=2, gpu_memory_budget="8GiB"))
    res = sim.run(trace)
    recs = [{"model": r.model, "arrival": r.arrival, "first_token": r.first_token, "finish": r.finish,
             "output_tokens": r.output_tokens} for r in res.records]
    return {"summary": res.summary()["all"], "records": recs}


def figures(summary: dict) -> dict:
    return {k: {q: round(summary[k][q] * 1e3, 1) for q in ("mean", "p50", "p99")} for k in ("latency", "ttft", "tpot")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit-on", default="default", choices=sorted(CAL))
    ap.add_argument("--out", default=None, help="default: bench/results/sim_validate/transfer_<fit-on>.json")
    a = ap.parse_args()
    trace = [Arrival(d["time"], d["model"], d["prompt_tokens"], d["output_tokens"])
             for d in map(json.loads, (D / "validate_trace.jsonl").read_text().splitlines())]
    measured = {p: json.loads((D / f"validate_measured_{p}.json").read_text()) for p in CAL}
    cals = {p: Calibration.load(D / f) for p, f in CAL.items()}
    before = {p: simulate(p, cals[p], trace) for p in CAL}
    (m_terms, m_n), (s_terms, s_n) = step_terms(measured[a.fit_on]["records"]), step_terms(before[a.fit_on]["records"])
    delta = m_terms - s_terms
    extra = np.maximum(delta, 0.0)  # a cost the server adds cannot be negative (a fit's noise can)
    out = {"fit_on": a.fit_on,
           "server_terms_s": {"per_step": extra[0], "per_stream": extra[1], "per_admission": extra[2]},
           "fitted_measured_s": m_terms.tolist(), "fitted_simulated_s": s_terms.tolist(),
           "fitted_difference_s": delta.tolist(), "requests_fitted": {"measured": m_n, "simulated": s_n}, "policies": {}}
    rows = []
    for p, cal in cals.items():
        adj = replace(cal, name=f"{cal.name} + server terms from the {a.fit_on} run",
                      decode_fixed_s=cal.decode_fixed_s + extra[0], prefill_fixed_s=cal.prefill_fixed_s + extra[0] + extra[2],
                      decode_seq_s=cal.decode_seq_s + extra[1])
        after = simulate(p, adj, trace)
        out["policies"][p] = {"held_out": p != a.fit_on, "measured": figures(measured[p]["summary"]["all"]),
                              "simulated_before": figures(before[p]["summary"]),
                              "simulated_after": figures(after["summary"])}
        for k in ("measured", "simulated_before", "simulated_after"):
            f = out["policies"][p][k]
            rows.append(f"{p:9s} {k:17s} latency {f['latency']['mean']:7.0f} {f['latency']['p50']:7.0f} "
                        f"{f['latency']['p99']:7.0f}  TTFT p50 {f['ttft']['p50']:6.0f}  TPOT p50 {f['tpot']['p50']:5.1f}")
    Path(a.out or D / f"transfer_{a.fit_on}.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"server terms fitted on the {a.fit_on} run: {extra[0] * 1e3:.2f} ms per step, {extra[1] * 1e3:.3f} ms per "
          f"stream, {extra[2] * 1e3:.1f} ms per admission (fitted differences {np.round(delta * 1e3, 3).tolist()} ms)")
    print("policy    run               latency mean / p50 / p99 (ms)      TTFT p50   TPOT p50")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
