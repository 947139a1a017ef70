"""A trace replayed in real time against the engine alone (no HTTP), every step timed (issue 11).

Between loadgen through the server (measured) and the simulator (predicted) sits the engine itself:
the same scheduler and executor in real time, without the server. This replays a trace's requests at
their arrival times straight into ``Engine.submit`` (the prompts loadgen would send), steps the
engine, and records:

- per request: arrival, first token, finish (loadgen's fields, so the summary is loadgen's);
- per step: its wall time, what it ran (prefills and their tokens, decodes, loads) and the time the
  calibration predicts for it (``sim.costs.batch_time``), so the residual is split by kind of step
  (steady decode, decode whose batch changed, prefill, with a load); the file keeps the steps that
  ran longest past their prediction.

If the engine alone matches the server, the server is not where the simulator's gap is; if it matches
the simulator, the server is. Writes one JSON file.

    PYTHONPATH=src python bench/engine_replay.py --trace T.jsonl --models opt-1.3b=a,opt-1.3b=b,opt-1.3b=c \\
        --budget 8GiB --max-loaded 2 --calibration CAL.json --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from computron.bench.common import machine, write_json  # noqa: E402
from computron.config import EngineConfig, ModelSpec, parse_bytes  # noqa: E402
from computron.engine import Engine, SamplingParams  # noqa: E402
from computron.sim.costs import batch_time, calibration  # noqa: E402
from computron.workload.loadgen import LoadRecord, prompt_ids  # noqa: E402
from computron.workload.report import by_model  # noqa: E402
from computron.workload.trace import Trace  # noqa: E402


def replay(eng: Engine, trace: Trace, cal) -> tuple[list[LoadRecord], list[dict]]:
    records = [LoadRecord(i, a.model, a.time, a.prompt_tokens, a.output_tokens) for i, a in enumerate(trace)]
    nbytes = {name: entry.nbytes for name, entry in eng.models.items()}
    reqs, steps, nxt = {}, [], 0
    prev_decode: dict[str, set] = {}
    t0 = time.perf_counter()
    while nxt < len(records) or any(not r.done for r in reqs.values()):
        now = time.perf_counter() - t0
        while nxt < len(records) and records[nxt].arrival <= now:
            rec = records[nxt]
            params = SamplingParams(max_tokens=rec.output_tokens, temperature=0.0, ignore_eos=True)
            reqs[rec.id] = eng.submit(rec.model, prompt_ids(rec.prompt_tokens, rec.id), params)
            nxt += 1
        if not eng.has_work():
            if nxt < len(records):
                time.sleep(max(0.0, min(0.01, records[nxt].arrival - (time.perf_counter() - t0))))
            continue
        held = {rid: len(r.prompt_ids) + len(r.output_ids) for rid, r in eng.requests.items()}  # what a prefill computes
        start = time.perf_counter()
        plan = eng.step()
        wall = time.perf_counter() - start
        batches, predicted = [], 0.0
        for b in plan.batches:
            tokens = sum(held.get(r, 0) for r in b.prefill)
            decode = set(b.decode)
            changed = decode != prev_decode.get(b.model)
            prev_decode[b.model] = decode
            predicted += batch_time(cal, nbytes[b.model], tokens, len(b.decode), len(b.prefill))
            batches.append({"model": b.model, "prefill": len(b.prefill), "prefill_tokens": tokens,
                            "decode": len(b.decode), "changed": changed})
        steps.append({"t": start - t0, "wall_s": wall, "predicted_s": predicted * plan.steps, "steps": plan.steps,
                      "loads": list(plan.loads), "batches": batches})
    for rec in records:
        r = reqs[rec.id]
        rec.first_token = None if r.first_token_at is None else r.first_token_at - t0
        rec.finish = None if r.finished_at is None else r.finished_at - t0
        rec.arrival = r.arrival - t0
        rec.completion_tokens = len(r.output_ids)
        rec.error = r.error
    return records, steps


def kind(step: dict) -> str:
    if step["loads"]:
        return "with a load"
    if any(b["prefill"] for b in step["batches"]):
        return "prefill"
    if not step["batches"]:
        return "empty"
    return "decode, batch changed" if any(b["changed"] for b in step["batches"]) else "decode, steady"


def residuals(steps: list[dict]) -> dict:
    out = {}
    for k in sorted({kind(s) for s in steps}):
        mine = [s for s in steps if kind(s) == k]
        res = [s["wall_s"] - s["predicted_s"] for s in mine]
        out[k] = {"steps": len(mine), "wall_s": sum(s["wall_s"] for s in mine),
                  "predicted_s": sum(s["predicted_s"] for s in mine), "residual_s": sum(res),
                  "residual_median_ms": statistics.median(res) * 1e3}
    return out


def compact(result: dict, keep: int = 40) -> dict:
    """The result without its full step log (tens of thousands of steps): the ``keep`` steps that ran
    longest past their prediction, and the count."""
    steps = result.pop("steps")
    result["steps_total"] = len(steps)
    result["slowest_steps"] = sorted(steps, key=lambda s: s["predicted_s"] - s["wall_s"])[:keep]
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--models", required=True, help="comma-separated model specs (SOURCE=ALIAS)")
    ap.add_argument("--budget", default=None)
    ap.add_argument("--policy", default="default")
    ap.add_argument("--max-loaded", type=int, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--calibration", required=True, help="a calibration file (or built-in name) to predict steps")
    ap.add_argument("--no-run-ahead", action="store_true", help="the executor never queues the next decode step early")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    try:  # what can be wrong is found before the engine starts, and said in one line
        cal = calibration(a.calibration)
        trace = Trace.read_jsonl(a.trace)
        specs = [ModelSpec.parse(spec) for spec in a.models.split(",")]
        missing = sorted({r.model for r in trace} - {s.name for s in specs})
        if missing:
            raise ValueError(f"the trace asks for models not in --models: {', '.join(missing)}")
        kw = {"device": a.device, "policy": a.policy, "run_ahead": not a.no_run_ahead}
        if a.budget:
            kw["gpu_memory_budget"] = parse_bytes(a.budget)
        if a.max_loaded:
            kw["max_loaded"] = a.max_loaded
        eng = Engine(EngineConfig(**kw))
        for spec in specs:
            eng.register_model(spec)
    except (OSError, ValueError) as e:  # EngineError and TraceFormatError are ValueErrors
        print(f"engine_replay: {e}", file=sys.stderr)
        return 2
    records, steps = replay(eng, trace, cal)
    summary = by_model(records)
    res = residuals(steps)
    allr = summary["all"]
    print(f"engine alone: latency mean/p50/p99 {allr['latency']['mean'] * 1e3:.0f} / {allr['latency']['p50'] * 1e3:.0f}"
          f" / {allr['latency']['p99'] * 1e3:.0f} ms, TTFT p50 {allr['ttft']['p50'] * 1e3:.1f} ms, "
          f"TPOT p50 {allr['tpot']['p50'] * 1e3:.2f} ms; {len(steps)} steps")
    for k, v in res.items():
        print(f"  {k:22s} {v['steps']:6d} steps  wall {v['wall_s']:7.2f} s  predicted {v['predicted_s']:7.2f} s  "
              f"median residual {v['residual_median_ms']:+.2f} ms")
    stats = dict(eng.executor.status().stats)
    print(f"  graph captures {stats.get('graph_captures')} in {stats.get('graph_capture_s', 0):.2f} s; swap-ins "
          f"{eng.stats['swap_ins']}")
    write_json(a.out, compact({"machine": machine(), "settings": vars(a), "summary": summary, "residuals": res,
                               "executor_stats": stats, "engine_stats": dict(eng.stats),
                               "steps": steps, "records": [r.__dict__ for r in records]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
