"""Where a batch-1 decode step's GPU time goes: the kernels of one resident model's eager decode
steps (torch.profiler, CUDA activity), per step: total kernel time, kernel count, and the kernels
that take the most time. Beside it, in the same run, the weight-read floor (one pass reading as
many bytes as the weights), so kernel time can be read against what the step must at least cost.

    python bench/decode_profile.py opt-1.3b llama-3-8b [--steps 10]

Writes bench/results/decode_profile_<gpu>.json (GPU only).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from computron.bench.decode import weight_read_floor_s  # noqa: E402
from computron.config import EngineConfig, ModelSpec  # noqa: E402
from computron.engine import Engine, SamplingParams  # noqa: E402


def profile_model(model: str, steps: int) -> dict:
    eng = Engine(EngineConfig(device="cuda", gpu_memory_budget=40 * 2**30, workspace_bytes=4 * 2**30,
                              cuda_graphs=False, max_batch_size=8))
    eng.register_model(ModelSpec(model))
    eng.load(model, wait=True)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    eng.generate(model, list(range(1, 129)), params)  # warm-up: kernels compiled and tuned
    eng.submit(model, list(range(1, 129)), params)
    eng.step(); eng.step()  # prefill, one decode
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
    torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    nbytes = eng.models[model].nbytes
    floor = weight_read_floor_s(nbytes, torch.device("cuda"))
    del eng
    torch.cuda.empty_cache()
    return {"weight_bytes": nbytes, "weight_read_floor_s": floor, "steps": steps,
            "kernel_s_per_step": sum(e.device_time_total for e in rows) / steps / 1e6,
            "kernels_per_step": sum(e.count for e in rows) / steps,
            "top": [{"name": e.key[:80], "calls_per_step": e.count / steps, "mean_us": e.device_time_total / e.count,
                     "s_per_step": e.device_time_total / steps / 1e6} for e in rows[:12] if e.count]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="+")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    res = {"gpu": name, "batch": 1, "prompt_len": 128, "cuda_graphs": False,
           "models": {m: profile_model(m, args.steps) for m in args.model}}
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-").split("-")[0]
    out = Path(args.out or f"bench/results/decode_profile_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    for m, r in res["models"].items():
        print(f"{m}: {r['kernel_s_per_step'] * 1e3:.3f} ms of kernels per step in {r['kernels_per_step']:.0f} kernels; "
              f"weight-read floor {r['weight_read_floor_s'] * 1e3:.3f} ms")
        for t in r["top"][:6]:
            print(f"   {t['calls_per_step']:6.0f} x {t['mean_us']:7.2f} us  {t['name']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
