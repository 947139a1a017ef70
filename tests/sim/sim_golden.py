"""Seeded simulations whose every per-request result is pinned (``sim_golden.json``): scheduler, core
and simulator changes made for speed must not change what a simulation decides.

The golden file was made by the code before those changes (main at 1922e61), with
``PYTHONPATH=src python tests/sim/sim_golden.py``; ``test_sim_golden.py`` compares against it.
Remake it only for a change meant to alter what the simulator decides, and say so in the commit.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from computron.config import EngineConfig
from computron.sim import Simulation
from computron.sim.costs import H200_ROUGH

GOLDEN = Path(__file__).with_name("sim_golden.json")
THREE = ["opt-6.7b", "llama-2-7b", "opt-1.3b"]  # bench/sim_speed.py's models
SMALL = ["opt-1.3b=a", "opt-1.3b=b", "opt-350m=c"]


def gamma_trace(n: int, models: list[str], rate: float, cv: float, seed: int) -> list[tuple]:
    """As bench/sim_speed.py's: Gamma inter-arrivals per model."""
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv)
    out = []
    for m in models:
        t = 0.0
        for _ in range(n // len(models)):
            t += rng.gammavariate(shape, 1.0 / (rate * shape))
            out.append((t, m, rng.randint(16, 512), rng.randint(8, 256)))
    out.sort(key=lambda a: a[0])
    return out


def bursty_trace(n: int, models: list[str], seed: int) -> list[tuple]:
    """As tests/sim/test_fast_forward.py's: bursts and gaps."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(40.0) if rng.random() < 0.8 else rng.uniform(0.2, 1.0)
        out.append((t, rng.choice(models), rng.randint(1, 700), rng.randint(1, 300)))
    return out


# name -> (models, trace, engine config keywords, fast_forward)
CASES = {
    "default-bench": (THREE, lambda: gamma_trace(1500, THREE, 8.0, 2.0, 1), {"gpu_memory_budget": 30 * 2**30}, True),
    "default-tight": (SMALL, lambda: bursty_trace(400, ["a", "b", "c"], 2),
                      {"gpu_memory_budget": "3.2GiB", "max_batch_size": 64}, True),
    "default-single": (SMALL, lambda: bursty_trace(250, ["a", "b", "c"], 1),
                       {"gpu_memory_budget": "6GiB", "max_batch_size": 8}, False),
    "computron": (SMALL, lambda: bursty_trace(400, ["a", "b", "c"], 3),
                  {"gpu_memory_budget": "8GiB", "policy": "computron", "max_loaded": 1}, True),
    "slo": (THREE, lambda: gamma_trace(1200, THREE, 10.0, 2.0, 4),
            {"gpu_memory_budget": 30 * 2**30, "policy": "slo"}, True),
    "slo-tight": (SMALL, lambda: bursty_trace(400, ["a", "b", "c"], 5),
                  {"gpu_memory_budget": "3.2GiB", "policy": "slo", "max_batch_size": 64}, True),
    "preempt": (THREE, lambda: gamma_trace(1200, THREE, 8.0, 2.0, 7),
                {"gpu_memory_budget": 30 * 2**30, "policy": "preempt", "max_wait_s": 0.5}, True),
    "preempt-keep": (SMALL, lambda: bursty_trace(400, ["a", "b", "c"], 6),
                     {"gpu_memory_budget": "3.2GiB", "policy": "preempt", "preempt_keeps_kv": True,
                      "max_batch_size": 64}, True),
}


def outcome(name: str) -> dict:
    """One case's results: every request's (id, tokens made, first token and finish times exactly,
    finish reason, error) as a digest, beside the step count, the end time and the core's counters."""
    models, trace, kw, ff = CASES[name]
    sim = Simulation(models, H200_ROUGH, EngineConfig(device="cpu", **kw), fast_forward=ff)
    made, record = {}, sim.core.on_finish

    def finished(req):
        made[req.id] = len(req.output_ids)
        record(req)

    sim.core.on_finish = finished
    res = sim.run(trace())
    rows = [[r.id, made.get(r.id), r.first_token.hex() if r.first_token is not None else None,
             r.finish.hex() if r.finish is not None else None, r.finish_reason, r.error] for r in res.records]
    digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()
    return {"requests": len(rows), "completed": sum(r.ok for r in res.records),
            "errors": sum(r.finish_reason == "error" for r in res.records), "steps": res.steps,
            "end_time": res.end_time.hex(), "stats": res.stats, "tokens": sum(v for v in made.values()),
            "switches": sim.core.scheduler.switches, "digest": digest}


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps({n: outcome(n) for n in CASES}, indent=1) + "\n")
    print(GOLDEN.read_text())
