"""What the caching allocator's release costs: ``empty_cache`` time against the bytes and blocks it frees.

A colocated training job gives memory back by emptying the caching allocator's cache. This
measures that call alone, on an idle GPU, for caches of ``--totals-gb`` made of blocks of each
``--blocks-mb`` size (and of a mix of sizes, as a training step leaves), ``--reps`` times each; and,
as the reference in the same run, a ``torch.cuda.synchronize()`` on the idle GPU. If the time grows
with the bytes freed, a release of only what a demand needs is cheaper than emptying the whole
cache by the ratio of the two.

Then the same under ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` (a child process; the
backend is chosen at the first allocation): ``empty_cache`` there, and the partial release that
backend allows, the device's memory pool trimmed by ``--demand-gb`` (``computron.colocate.devpool``),
with the bytes each gave back. Writes bench/results/release_cost_<tag>.json.

    PYTHONPATH=src python bench/release_cost.py --tag h200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

MB = 1 << 20
GB = 1 << 30
MIX_MB = (2, 8, 16, 32, 64, 128, 256, 786)  # sizes a GPT-2-medium micro-batch of 16 x 512 allocates, roughly


def sizes(total: int, block_mb: int | None, rng: random.Random) -> list[int]:
    out, left = [], total
    while left > 0:
        s = min(left, (block_mb or rng.choice(MIX_MB)) * MB)
        out.append(s)
        left -= s
    return out


def once(device, total: int, block_mb: int | None, rng: random.Random) -> tuple[float, int]:
    """Fill the cache with ``total`` bytes of blocks, free them, and time the release; (seconds, segments)."""
    torch.cuda.empty_cache()
    ts = [torch.empty(s, dtype=torch.uint8, device=device) for s in sizes(total, block_mb, rng)]
    segments = torch.cuda.memory_stats(device)["segment.all.current"]
    del ts
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    torch.cuda.empty_cache()
    return time.perf_counter() - t0, segments


def trimmed(device, total: int, demand: int, rng: random.Random) -> dict:
    """Under the cudaMallocAsync backend: fill the pool with ``total`` bytes, free them, and time a trim that
    gives back ``demand`` bytes, then one of everything (``empty_cache``); the times and bytes given back."""
    from computron.colocate.devpool import DevicePool

    pool = DevicePool(device.index or 0)
    out = {}
    for how in ("trim", "empty_cache"):
        torch.cuda.empty_cache()
        ts = [torch.empty(s, dtype=torch.uint8, device=device) for s in sizes(total, None, rng)]
        del ts
        torch.cuda.synchronize(device)
        before = pool.reserved
        t0 = time.perf_counter()
        if how == "trim":
            pool.trim_to(before - demand)
        else:
            torch.cuda.empty_cache()
        out[f"{how}_ms"] = 1e3 * (time.perf_counter() - t0)
        out[f"{how}_gave_gb"] = (before - pool.reserved) / GB
    return out


def async_child(args) -> list[dict]:
    dev = torch.device("cuda")
    assert torch.cuda.get_allocator_backend() == "cudaMallocAsync", torch.cuda.get_allocator_backend()
    rng = random.Random(0)
    trimmed(dev, 256 * MB, 64 * MB, rng)
    rows = []
    for tgb in (float(x) for x in args.totals_gb.split(",")):
        if tgb <= args.demand_gb:
            continue
        runs = [trimmed(dev, int(tgb * GB), int(args.demand_gb * GB), rng) for _ in range(args.reps)]
        row = {"total_gb": tgb, "demand_gb": args.demand_gb}
        for k in runs[0]:
            row[k] = statistics.median(r[k] for r in runs)
        rows.append(row)
        print(f"cudaMallocAsync {tgb:5.1f} GB: trim by {args.demand_gb} GB {row['trim_ms']:6.2f} ms (gave "
              f"{row['trim_gave_gb']:.2f} GB); empty_cache {row['empty_cache_ms']:6.2f} ms (gave "
              f"{row['empty_cache_gave_gb']:.2f} GB)", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--totals-gb", default="0.5,1,2.5,5,10,20")
    ap.add_argument("--blocks-mb", default="16,64,256,mix", help="block sizes; mix: random sizes of MIX_MB")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--demand-gb", type=float, default=2.45, help="what the partial release gives back")
    ap.add_argument("--async-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    try:
        totals = [float(x) for x in args.totals_gb.split(",")]
        blocks = [None if b == "mix" else int(b) for b in args.blocks_mb.split(",")]
    except ValueError as e:
        ap.error(f"--totals-gb takes GB numbers and --blocks-mb MB integers or 'mix', comma-separated ({e})")
    if any(t <= 0 for t in totals) or any(b is not None and b <= 0 for b in blocks) or args.reps < 1 \
            or args.demand_gb <= 0:
        ap.error("sizes, --demand-gb and --reps must be positive")
    if not torch.cuda.is_available():
        sys.exit("release_cost.py: needs a CUDA GPU")
    if args.async_child:
        print("ASYNC " + json.dumps(async_child(args)))
        return 0
    dev = torch.device("cuda")
    rng = random.Random(0)
    once(dev, 256 * MB, 64, rng)  # the context and the allocator warmed up
    sync = []
    for _ in range(args.reps * 3):
        t0 = time.perf_counter()
        torch.cuda.synchronize(dev)
        sync.append(time.perf_counter() - t0)
    rows = []
    for block_mb in blocks:
        b = "mix" if block_mb is None else str(block_mb)
        for tgb in totals:
            runs = [once(dev, int(tgb * GB), block_mb, rng) for _ in range(args.reps)]
            ms = [1e3 * s for s, _ in runs]
            row = {"blocks_mb": b, "total_gb": tgb, "segments": runs[0][1], "empty_cache_ms": statistics.median(ms),
                   "min_ms": min(ms), "max_ms": max(ms)}
            row["ms_per_gb"] = row["empty_cache_ms"] / tgb
            rows.append(row)
            print(f"blocks {b:>4} MB  {tgb:5.1f} GB  {row['segments']:5d} segments  empty_cache "
                  f"{row['empty_cache_ms']:7.2f} ms (min {row['min_ms']:.2f}, max {row['max_ms']:.2f})  "
                  f"{row['ms_per_gb']:.2f} ms/GB", flush=True)
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    child = subprocess.run([sys.executable, __file__, "--async-child", *(argv if argv is not None else sys.argv[1:])],
                           env=env, capture_output=True, text=True)
    print("\n".join(line for line in child.stdout.splitlines() if not line.startswith("ASYNC ")), child.stderr,
          flush=True)
    if child.returncode:
        sys.exit(f"release_cost.py: the cudaMallocAsync child failed ({child.returncode})")
    async_rows = json.loads(next(line[6:] for line in child.stdout.splitlines() if line.startswith("ASYNC ")))
    out = Path(args.out) / f"release_cost_{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "idle_synchronize_ms": 1e3 * statistics.median(sync), "rows": rows,
                               "cuda_malloc_async": async_rows,
                               "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    print(f"idle synchronize {1e3 * statistics.median(sync):.3f} ms; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
