"""Per-token cost of the worker process's control channel: decode time per token at batch 1, the
``workers`` executor (the in-process executor behind a pipe) against the ``inprocess`` one, for
each ``--decode-steps`` value (decode steps per engine call: the channel is crossed once per call).

    .venv/bin/python bench/worker_overhead.py [MODEL] [--device auto|cpu|cuda] [--runs 7] [--steps 64]
        [--decode-steps 1 8]

Both engines live in this one process (the worker's is its child), runs alternate between them
and between settings, and each run's figure is the wall time of its decode calls divided by the
tokens they made (one request of ``--prompt-len`` tokens, greedy, after its prefill); the result
is the median over runs. Also the round trip of a bare control call (``status``). Writes
bench/results/worker_overhead_<device>.json and prints a table.
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
    prompt = list(range(1, args.prompt_len + 1))
    for kind in ("inprocess", "workers"):
        eng = Engine(EngineConfig(device=device, executor=kind, gpu_memory_budget=args.budget))
        eng.register_model(args.model)
        eng.load(args.model, wait=True)
        for k in args.decode_steps:  # warm up (graphs, caches)
            eng.config.decode_steps = k
            per_token(eng, args.model, prompt, 2 * k + 2)
        engines[kind] = eng
    settings = [(kind, k) for k in args.decode_steps for kind in engines]
    per_run = {f"{kind}/{k}": [] for kind, k in settings}
    try:
        for _ in range(args.runs):
            for kind, k in settings:  # alternate: drifts hit every setting alike
                engines[kind].config.decode_steps = k
                per_run[f"{kind}/{k}"].append(per_token(engines[kind], args.model, prompt, args.steps))
        rtt = {k: round_trips(e) for k, e in engines.items()}
    finally:
        engines["workers"].executor.shutdown()
    tok = {key: statistics.median(v) for key, v in per_run.items()}
    overhead = {k: {"overhead_s": tok[f"workers/{k}"] - tok[f"inprocess/{k}"],
                    "overhead_ratio": tok[f"workers/{k}"] / tok[f"inprocess/{k}"]} for k in args.decode_steps}
    res = {
        "model": args.model, "device": device, "device_name": dev_name, "batch": 1, "prompt_len": args.prompt_len,
        "tokens_per_run": args.steps, "runs": args.runs, "torch": torch.__version__,
        "token_s": tok, "token_s_per_run": per_run, "status_round_trip_s": rtt, "by_decode_steps": overhead,
        "date": time.strftime("%Y-%m-%d"),
    }
    out = Path(args.out or Path(__file__).parent / "results" / f"worker_overhead_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"{args.model} on {device} ({dev_name}), batch 1, median of {args.runs} runs x {args.steps} tokens")
    print(f"{'steps/call':>10} {'inprocess':>12} {'workers':>12} {'overhead':>16}")
    for k in args.decode_steps:
        o = overhead[k]
        print(f"{k:>10} {tok[f'inprocess/{k}'] * 1e3:>9.3f} ms {tok[f'workers/{k}'] * 1e3:>9.3f} ms "
              f"{o['overhead_s'] * 1e6:>+8.1f} µs {(o['overhead_ratio'] - 1) * 100:+.1f}%")
    print("status() round trip: " + ", ".join(f"{k} {v * 1e6:.1f} µs" for k, v in rtt.items()) + f"  -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
