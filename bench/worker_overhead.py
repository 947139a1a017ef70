"""Per-step cost of the worker process's control channel: decode step time at batch 1, the
``workers`` executor (the in-process executor behind a pipe) against the ``inprocess`` one.

    .venv/bin/python bench/worker_overhead.py [MODEL] [--device auto|cpu|cuda] [--runs 7] [--steps 64]

Both engines live in this one process (the worker's is its child), runs alternate between them,
and each run's figure is the median decode step (``Engine.step`` wall time, one request of
``--prompt-len`` tokens, greedy); the result is the median over runs. Also the round trip of a
bare control call (``status``). Writes bench/results/worker_overhead_<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from computron.config import EngineConfig  # noqa: E402
from computron.engine import Engine, SamplingParams  # noqa: E402


def decode_steps(eng: Engine, model: str, prompt: list[int], steps: int) -> list[float]:
    req = eng.submit(model, prompt, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    eng.step()  # prefill
    times = []
    while not req.done:
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return times


def round_trips(eng: Engine, n: int = 200) -> float:
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        eng.executor.status()
        t.append(time.perf_counter() - t0)
    return statistics.median(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="tiny-opt")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--budget", default=None, help="memory budget (default: the executor's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else \
        ("cpu" if args.device == "auto" else args.device)
    if device.startswith("cuda"):
        dev_name = torch.cuda.get_device_name(torch.device(device))
        slug = re.sub(r"[^a-z0-9]+", "-", dev_name.lower().replace("nvidia", "")).strip("-").split("-")[0]
    else:
        dev_name, slug = platform.processor() or platform.machine(), "cpu"
    engines = {}
    for kind in ("inprocess", "workers"):
        eng = Engine(EngineConfig(device=device, executor=kind, gpu_memory_budget=args.budget))
        eng.register_model(args.model)
        eng.load(args.model, wait=True)
        decode_steps(eng, args.model, list(range(1, args.prompt_len + 1)), 8)  # warm up (graphs, caches)
        engines[kind] = eng
    per_run = {k: [] for k in engines}
    try:
        for _ in range(args.runs):
            for kind, eng in engines.items():  # alternate: drifts hit both alike
                per_run[kind].append(statistics.median(
                    decode_steps(eng, args.model, list(range(1, args.prompt_len + 1)), args.steps)))
        rtt = {k: round_trips(e) for k, e in engines.items()}
    finally:
        engines["workers"].executor.shutdown()
    step = {k: statistics.median(v) for k, v in per_run.items()}
    res = {
        "model": args.model, "device": device, "device_name": dev_name, "batch": 1, "prompt_len": args.prompt_len,
        "decode_steps_per_run": args.steps, "runs": args.runs, "torch": torch.__version__,
        "step_s": step, "step_s_per_run": per_run, "status_round_trip_s": rtt,
        "overhead_s": step["workers"] - step["inprocess"],
        "overhead_ratio": step["workers"] / step["inprocess"],
        "date": time.strftime("%Y-%m-%d"),
    }
    out = Path(args.out or Path(__file__).parent / "results" / f"worker_overhead_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"{args.model} on {device} ({dev_name}), batch 1, median of {args.runs} runs x {args.steps} decode steps")
    print(f"{'executor':<10} {'decode step':>12} {'status() round trip':>20}")
    for k in engines:
        print(f"{k:<10} {step[k] * 1e3:>9.3f} ms {rtt[k] * 1e6:>17.1f} µs")
    print(f"overhead: {res['overhead_s'] * 1e6:+.1f} µs per step ({(res['overhead_ratio'] - 1) * 100:+.1f}%)  -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
