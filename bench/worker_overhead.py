"""Per-token cost of the worker process's control channel: decode time per token at batch 1, the
``workers`` executor (the in-process executor behind a pipe) against the ``inprocess`` one, for
each ``--decode-steps`` value (decode steps per engine call: the channel is crossed once per call),
with the workers' run-ahead (``engine/ahead.py``, the default) and without it
(``workers(run_ahead=off)``), and the in-process executor with the run-ahead (``inprocess(run_ahead)``,
its default on a GPU: the next step queued before this one's tokens are read back). The reference,
``inprocess``, is the plain in-process executor (``run_ahead`` off).

    .venv/bin/python bench/worker_overhead.py [MODEL] [--device auto|cpu|cuda] [--runs 7] [--steps 64]
        [--decode-steps 1 8] [--threads N]

All engines live in this one process (the workers' are its children), runs alternate between them
and between settings, and each run's figure is the wall time of its decode calls divided by the
tokens they made (one request of ``--prompt-len`` tokens, greedy, after its prefill); the result
is the median over runs. Also the round trip of a bare control call (``status``) and how many steps
each worker served from a step run ahead or dropped. ``--threads``: CPU threads of each process's
torch (on a small CPU machine, two processes of two threads each would share two cores). Writes
bench/results/worker_overhead_<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from computron.config import EngineConfig  # noqa: E402
from computron.engine import Engine, SamplingParams  # noqa: E402


def per_token(eng: Engine, model: str, prompt: list[int], steps: int) -> float:
    """Seconds per decoded token of one request (after its prefill)."""
    req = eng.submit(model, prompt, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    eng.step()  # prefill
    t0 = time.perf_counter()
    while not req.done:
        eng.step()
    return (time.perf_counter() - t0) / steps


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
    ap.add_argument("--decode-steps", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--budget", default=None, help="memory budget (default: the executor's)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads per process (default: torch's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the workers (spawned) read it when torch starts

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else \
        ("cpu" if args.device == "auto" else args.device)
    if device.startswith("cuda"):
        dev_name = torch.cuda.get_device_name(torch.device(device))
        slug = re.sub(r"[^a-z0-9]+", "-", dev_name.lower().replace("nvidia", "")).strip("-").split("-")[0]
    else:
        dev_name, slug = platform.processor() or platform.machine(), "cpu"
    engines = {}
    prompt = list(range(1, args.prompt_len + 1))
    variants = {"inprocess": ("inprocess", False), "inprocess(run_ahead)": ("inprocess", True),
                "workers": ("workers", True), "workers(run_ahead=off)": ("workers", False)}
    for name, (kind, ahead) in variants.items():
        eng = Engine(EngineConfig(device=device, executor=kind, gpu_memory_budget=args.budget, run_ahead=ahead))
        eng.register_model(args.model)
        eng.load(args.model, wait=True)
        for k in args.decode_steps:  # warm up (graphs, caches)
            eng.config.decode_steps = k
            per_token(eng, args.model, prompt, 2 * k + 2)
        engines[name] = eng
    load_before = os.getloadavg()[0]  # other work on the machine: the overlap needs a free core on the CPU
    settings = [(kind, k) for k in args.decode_steps for kind in engines]
    per_run = {f"{kind}/{k}": [] for kind, k in settings}
    try:
        for _ in range(args.runs):
            for kind, k in settings:  # alternate: drifts hit every setting alike
                engines[kind].config.decode_steps = k
                per_run[f"{kind}/{k}"].append(per_token(engines[kind], args.model, prompt, args.steps))
        stats = {k: {s: v for s, v in e.executor.status().stats.items() if s.startswith("run_ahead")}
                 for k, e in engines.items() if k != "inprocess"}
        rtt = {k: round_trips(e) for k, e in engines.items()}
    finally:
        for k, e in engines.items():
            e.executor.shutdown()
    tok = {key: statistics.median(v) for key, v in per_run.items()}
    workers = [k for k in engines if k != "inprocess"]

    def over(kind: str) -> dict:
        return {k: {"overhead_s": tok[f"{kind}/{k}"] - tok[f"inprocess/{k}"],
                    "overhead_ratio": tok[f"{kind}/{k}"] / tok[f"inprocess/{k}"]} for k in args.decode_steps}

    res = {
        "model": args.model, "device": device, "device_name": dev_name, "batch": 1, "prompt_len": args.prompt_len,
        "tokens_per_run": args.steps, "runs": args.runs, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "token_s": tok, "token_s_per_run": per_run, "status_round_trip_s": rtt,
        "by_decode_steps": over("workers"), "by_decode_steps_run_ahead_off": over("workers(run_ahead=off)"),
        "by_decode_steps_inprocess_run_ahead": over("inprocess(run_ahead)"),
        "worker_stats": stats, "cpus": os.cpu_count(), "load_average_1min": [load_before, os.getloadavg()[0]],
        "date": time.strftime("%Y-%m-%d"),
    }
    out = Path(args.out or Path(__file__).parent / "results" / f"worker_overhead_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"{args.model} on {device} ({dev_name}), batch 1, median of {args.runs} runs x {args.steps} tokens")
    print(f"{'steps/call':>10} {'executor':>24} {'per token':>12} {'overhead':>20}")
    for k in args.decode_steps:
        print(f"{k:>10} {'inprocess':>24} {tok[f'inprocess/{k}'] * 1e3:>9.3f} ms")
        for kind in workers:
            o = over(kind)[k]
            print(f"{k:>10} {kind:>24} {tok[f'{kind}/{k}'] * 1e3:>9.3f} ms {o['overhead_s'] * 1e6:>+10.1f} µs "
                  f"{(o['overhead_ratio'] - 1) * 100:+6.1f}%")
    print("run-ahead: " + ", ".join(f"{k} {v}" for k, v in stats.items()) +
          f"; load average before/after: {load_before:.2f}/{res['load_average_1min'][1]:.2f} on {os.cpu_count()} CPUs")
    print("status() round trip: " + ", ".join(f"{k} {v * 1e6:.1f} µs" for k, v in rtt.items()) + f"  -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
