"""Why the simulator was optimistic for the computron policy on the H100, from the committed runs alone.

Reads bench/results/sim_validate_h100/ (the measured run of ``gpu_sim_validate.sh computron``, its
served calibration of the legacy executor, and the server's swap counters loadgen kept) and derives
what the calibration lacks, writing ``calibration_gpu_legacy_served_v2.json`` (the served calibration
plus the derived terms) and ``legacy_derivation.json`` (every figure below):

1. Page-locked host memory allocated by evictions (``evict_pin_s_per_byte``). The server's counters
   over the replay: 64 swaps (loads and evictions together) in 7.70 s. The probes loadgen sends first
   leave two models resident, and the replay ends with two, so 32 loads and 32 evictions. Loads (from
   page-locked copies: every model was evicted before its next load) and steady evictions cost what
   the calibration says; the rest is the allocations. How many: the simulator's own count of the
   replay's evictions that found no freed copy to reuse (three: four page-locked copies in all, one
   made during the probes).
2. The step. An attribution lens: between two events of the records (first tokens, finishes) the
   computron policy steps one model, the one with running requests whose oldest outstanding request
   is oldest; a request's tokens are one per step of its model, so its decode time while its model
   stepped over its tokens is its model's step, at its time-averaged batch. Per request, that step
   less the calibration's decode step at its batch is fitted (least absolute deviations, robust to
   the few stalls) as a per-step excess plus a per admission step (distinct first tokens of its model
   in its decode) excess. The lens is checked on the simulated run, whose truth is the calibration.
   Measured minus simulated: what a decode step and an admission step cost more than calibrated.
   ``sim_validate_transfer.step_terms`` (requests no other model's event shared) is reported beside
   it: under this policy most requests share the device with another model's paused requests.
3. The derived calibration re-simulated with loadgen's probes first (``--loadgen-probes``), and the
   lens applied to that run (its per-step excess must come back as the measured one); a bootstrap of
   the per-step excess gives its spread, simulated at both ends (the overloaded run amplifies it).

    PYTHONPATH=src python bench/sim_validate_legacy.py

An estimate from one run: ``bench calibrate --executor legacy`` now measures the first (pageable)
swap-in and the allocation; the step's excess under load is the calibration's gap (README).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sim_validate_transfer import figures, step_terms  # noqa: E402

from computron.config import EngineConfig  # noqa: E402
from computron.sim import Simulation  # noqa: E402
from computron.sim.costs import Calibration, batch_time  # noqa: E402
from computron.sim.run import Arrival  # noqa: E402

R = Path(__file__).parent / "results"
D = R / "sim_validate_h100"
MODELS = ["opt-1.3b=a", "opt-1.3b=b", "opt-1.3b=c"]
CONFIG = dict(device="cpu", policy="computron", max_loaded=2, gpu_memory_budget="8GiB")


def trace() -> list[Arrival]:
    return [Arrival(d["time"], d["model"], d["prompt_tokens"], d["output_tokens"])
            for d in map(json.loads, (R / "sim_validate" / "validate_trace.jsonl").read_text().splitlines())]


def simulate(cal: Calibration) -> tuple[list[dict], dict, dict]:
    """The trace after loadgen's probes: (records, summary, core counters)."""
    sim = Simulation(MODELS, cal, EngineConfig(**CONFIG))
    tr = trace()
    sim.probe(tr)
    pinned_before = sim.executor.stats["pinned_bytes"]  # during the probes
    res = sim.run(tr)
    recs = [{"model": r.model, "arrival": r.arrival, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
             "first_token": r.first_token, "finish": r.finish} for r in res.records]
    return recs, res.summary(), {**res.stats, "pinned_bytes": sim.executor.stats["pinned_bytes"] - pinned_before}


def lens(records: list[dict]) -> list[dict]:
    """Per request (20 tokens or more, no model switch while its model stepped): its model's step while
    it decoded, the time-averaged batch, and admission steps of its model per token (module docstring)."""
    recs = [r for r in records if r["first_token"] is not None]
    models = sorted({r["model"] for r in recs})
    events = sorted({r["first_token"] for r in recs} | {r["finish"] for r in recs})
    firsts: dict[float, set] = {}
    for r in recs:
        firsts.setdefault(r["first_token"], set()).add(r["model"])
    spans = []  # (start, end, model that steps, its batch, whether another model starts at the end)
    for t0, t1 in zip(events, events[1:]):
        mid = (t0 + t1) / 2
        running, oldest = dict.fromkeys(models, 0), {}
        for r in recs:
            if r["arrival"] <= mid < r["finish"]:
                oldest[r["model"]] = min(oldest.get(r["model"], np.inf), r["arrival"])
                if r["first_token"] <= mid:
                    running[r["model"]] += 1
        busy = [m for m in models if running[m]]
        if busy:
            m = min(busy, key=oldest.__getitem__)
            spans.append((t0, t1, m, running[m], any(x != m for x in firsts.get(t1, ()))))
    out = []
    for r in recs:
        n, a, b = r["output_tokens"], r["first_token"], r["finish"]
        if n < 20:
            continue
        mine = [(t0, t1, batch, switch) for t0, t1, m, batch, switch in spans if m == r["model"] and t1 > a and t0 < b]
        if not mine or any(s for *_, s in mine):
            continue  # a load and another model's prefill ended a span it stepped in
        t = sum(t1 - t0 for t0, t1, *_ in mine)
        adm = sorted(q["first_token"] for q in recs if q["model"] == r["model"] and a < q["first_token"] <= b)
        steps = sum(1 for i, x in enumerate(adm) if i == 0 or x - adm[i - 1] > 2e-3)  # one step admits several
        out.append({"t": a, "step": t / (n - 1), "batch": sum((t1 - t0) * k for t0, t1, k, _ in mine) / t,
                    "admissions_per_token": steps / (n - 1)})
    return out


def excess(rows: list[dict], cal: Calibration, nbytes: int) -> np.ndarray:
    """Per request: (its step less the calibration's decode step at its batch, admission steps per token)."""
    return np.array([(o["step"] - batch_time(cal, nbytes, 0, max(1, round(o["batch"]))), o["admissions_per_token"])
                     for o in rows])


def lad(x: np.ndarray) -> np.ndarray:
    """Least absolute deviations of excess = a + b * admissions per token (iteratively reweighted)."""
    a = np.c_[np.ones(len(x)), x[:, 1]]
    c = np.linalg.lstsq(a, x[:, 0], rcond=None)[0]
    for _ in range(300):
        w = np.sqrt(1 / np.maximum(np.abs(x[:, 0] - a @ c), 1e-6))
        c = np.linalg.lstsq(a * w[:, None], x[:, 0] * w, rcond=None)[0]
    return c


def main() -> None:
    served = Calibration.load(D / "calibration_gpu_legacy_served.json")
    measured = json.loads((D / "validate_measured_computron.json").read_text())
    nbytes = Simulation(MODELS[:1], served).executor.models["a"].nbytes
    out: dict = {"measured": figures(measured["summary"]["all"])}

    # 1. page-locked allocations, from the server's swap counters over the replay
    srv = measured["summary"]["server"]
    swaps, swap_s = srv["computron_model_swaps_total"], srv["computron_swap_seconds_sum"]
    loads = evictions = swaps / 2  # two resident when the replay starts (after the probes) and when it ends
    _, _, counters = simulate(served)
    allocs = round(counters["pinned_bytes"] / nbytes)
    steady = loads * served.load_time(nbytes) + evictions * (served.evict_s + served.evict_s_per_byte * nbytes)
    pin = (swap_s - steady) / (allocs * nbytes)
    out["pinning"] = {"swaps": swaps, "swap_seconds": swap_s, "loads": loads, "evictions": evictions,
                      "steady_seconds": steady, "allocations": allocs, "seconds_each": (swap_s - steady) / allocs,
                      "evict_pin_s_per_byte": pin}
    print(f"1. swaps over the replay {swaps:.0f} in {swap_s:.2f} s; {loads:.0f} loads and {evictions:.0f} evictions "
          f"at the calibration's cost {steady:.2f} s; {allocs} allocations of page-locked copies: "
          f"{(swap_s - steady) / allocs:.2f} s each, {pin * 1e9 * 1e3:.0f} ms/GB")
    pinned = replace(served, evict_pin_s_per_byte=pin)

    # 2. the step: the lens on the measured run and on the simulated one (same calibration, structural fixes)
    recs, summary, _ = simulate(pinned)
    m, s = excess(lens(measured["records"]), served, nbytes), excess(lens(recs), served, nbytes)
    fm, fs = lad(m), lad(s)
    step, admit = fm[0] - fs[0], fm[1] - fs[1]
    tm, ts = step_terms(measured["records"])[0], step_terms(recs)[0]
    out["lens"] = {"requests": {"measured": len(m), "simulated": len(s)},
                   "measured_ms": {"per_step": fm[0] * 1e3, "per_admission_step": fm[1] * 1e3},
                   "simulated_ms": {"per_step": fs[0] * 1e3, "per_admission_step": fs[1] * 1e3},
                   "derived_ms": {"per_step": step * 1e3, "per_admission_step": admit * 1e3},
                   "transfer_step_terms_ms": {"measured": (tm * 1e3).tolist(), "simulated": (ts * 1e3).tolist()}}
    rng = np.random.default_rng(0)
    boot = [lad(m[rng.integers(0, len(m), len(m))])[0] - fs[0] for _ in range(200)]
    lo, hi = np.percentile(boot, [10, 90])
    out["lens"]["per_step_bootstrap_ms"] = {"p10": lo * 1e3, "p90": hi * 1e3}
    print(f"2. lens, excess over the calibrated decode step (ms): measured {fm[0] * 1e3:.2f} per step + "
          f"{fm[1] * 1e3:.1f} per admission step ({len(m)} requests); simulated {fs[0] * 1e3:.2f} + {fs[1] * 1e3:.1f} "
          f"({len(s)}); derived: a step costs {step * 1e3:.2f} ms more (bootstrap p10-p90 {lo * 1e3:.2f}-"
          f"{hi * 1e3:.2f}), an admission step {admit * 1e3:.1f} ms more on top")
    print(f"   sim_validate_transfer.step_terms (per step, per stream, per admission, ms): measured "
          f"{np.round(tm * 1e3, 2).tolist()}, simulated {np.round(ts * 1e3, 2).tolist()}")

    # 3. the derived calibration, re-simulated; the lens on it; the spread of the per-step excess
    def derived(per_step: float) -> Calibration:
        return replace(pinned, name=f"{served.name} + terms derived from the H100 validation run "
                                    f"(bench/sim_validate_legacy.py)",
                       decode_fixed_s=served.decode_fixed_s + per_step,
                       prefill_fixed_s=served.prefill_fixed_s + per_step + max(admit, 0.0))

    cal = derived(step)
    cal.save(D / "calibration_gpu_legacy_served_v2.json")
    runs = {}
    for name, c in (("served", served), ("served + pinning", pinned), ("v2", cal),
                    ("v2, per step at p10", derived(lo)), ("v2, per step at p90", derived(hi))):
        r, summ, st = simulate(c)
        runs[name] = {"figures": figures(summ["all"]), "end_s": summ["end_time"], "swap_ins": st["swap_ins"],
                      "evictions": st["evictions"]}
        if name == "v2":
            back = lad(excess(lens(r), served, nbytes))
            runs[name]["lens_ms"] = {"per_step": back[0] * 1e3, "per_admission_step": back[1] * 1e3}
    out["simulated"] = runs
    out["calibration"] = cal.to_dict()
    (D / "legacy_derivation.json").write_text(json.dumps(out, indent=2) + "\n")
    f = out["measured"]
    print(f"3. latency mean / p50 / p99 (ms), TTFT p50, TPOT p50; measured {f['latency']['mean']:.0f} / "
          f"{f['latency']['p50']:.0f} / {f['latency']['p99']:.0f}, {f['ttft']['p50']:.0f}, {f['tpot']['p50']:.1f}")
    for name, r in runs.items():
        g = r["figures"]
        err = "  ".join(f"{(g['latency'][q] / f['latency'][q] - 1) * 100:+.0f}%" for q in ("mean", "p50", "p99"))
        print(f"   {name:22s} {g['latency']['mean']:6.0f} / {g['latency']['p50']:6.0f} / {g['latency']['p99']:6.0f} "
              f"({err}), {g['ttft']['p50']:.0f}, {g['tpot']['p50']:.1f}; {r['swap_ins']} loads, ends {r['end_s']:.1f} s"
              + (f"; lens on it {r['lens_ms']['per_step']:.2f} ms per step" if "lens_ms" in r else ""))
    print(f"wrote {D / 'calibration_gpu_legacy_served_v2.json'} and {D / 'legacy_derivation.json'}")


if __name__ == "__main__":
    main()
