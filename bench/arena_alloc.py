"""Host time of the arena's bookkeeping: a KV block released and another allocated, with N blocks live.

Every KV block is an arena region, so a serving step allocates one per sequence crossing a block
boundary and a prefill one per 16 prompt tokens; with thousands of blocks live the cost of one
allocation is what a prompt's blocks cost times their number. The arena (on the CPU: the
bookkeeping is the same on a GPU, and no bytes are copied) holds a weights region and N blocks;
then blocks chosen at random are released and allocated again, and the median over ``--runs`` of
the mean time per release + allocate is reported for each N. ``--reference-src`` at another
checkout's ``src`` (e.g. ``git worktree add --detach /tmp/ref <commit>``) measures that version in the
same run (each in a fresh process, alternating), and the two must place every block at the same
offsets. Writes bench/results/arena_alloc.json.

    PYTHONPATH=src python bench/arena_alloc.py [--blocks 100 1000 4000 16000] [--reference-src /tmp/ref/src]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from computron.bench.common import positive_int

CHILD = r"""
import json, random, sys, time, zlib
from computron.memory.arena import Arena
from computron.memory.units import ALIGN
n, ops = int(sys.argv[1]), int(sys.argv[2])
bb = 4 * ALIGN  # a block: the size does not matter to the bookkeeping, only that all blocks share it
arena = Arena(2**20 + (n + 64) * bb, "cpu")
arena.allocate(2**20, "weights", "m")
live = [arena.allocate(bb, "kv", "r") for _ in range(n)]
rng = random.Random(n)
picks = [rng.randrange(n) for _ in range(ops)]
crc = 0
t0 = time.perf_counter()
for i in picks:
    arena.release(live[i])
    live[i] = arena.allocate(bb, "kv", "r")
dt = time.perf_counter() - t0
for r in live:
    crc = zlib.crc32(r.offset.to_bytes(8, "little"), crc)
print(json.dumps({"us": dt / ops * 1e6, "offsets_crc": crc}))
"""


def _one(src: str, n: int, ops: int) -> dict:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(ops)], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=positive_int, nargs="+", default=[100, 1000, 4000, 16000])
    ap.add_argument("--ops", type=positive_int, default=2000)
    ap.add_argument("--runs", type=positive_int, default=5)
    ap.add_argument("--reference-src", default=None)
    ap.add_argument("--out", default="bench/results/arena_alloc.json")
    args = ap.parse_args(argv)
    if args.reference_src and not (Path(args.reference_src) / "computron" / "memory" / "arena.py").is_file():
        ap.error(f"--reference-src {args.reference_src} is not a checkout's src (no computron/memory/arena.py)")
    here = str(Path(__file__).resolve().parent.parent / "src")
    versions = {"this": here} | ({"reference": args.reference_src} if args.reference_src else {})
    rows = []
    for n in args.blocks:
        got = {v: [] for v in versions}
        for _ in range(args.runs):
            for v, src in versions.items():
                got[v].append(_one(src, n, args.ops))
        crcs = {r["offsets_crc"] for rs in got.values() for r in rs}
        if len(crcs) != 1:
            print(f"{n} blocks: the versions placed the blocks differently", file=sys.stderr)
            return 1
        rows.append({"blocks": n, **{f"{v}_us": statistics.median(r["us"] for r in rs) for v, rs in got.items()}})
    res = {"what": "median host us per KV block released and allocated again, N blocks live (CPU)",
           "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(), "host": platform.node()},
           "settings": vars(args), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"{'blocks':>8} " + " ".join(f"{v + ' us':>14}" for v in versions) + ("   speed-up" if len(versions) > 1 else ""))
    for r in rows:
        line = f"{r['blocks']:>8} " + " ".join(f"{r[v + '_us']:>14.2f}" for v in versions)
        if "reference_us" in r:
            line += f"   {r['reference_us'] / r['this_us']:>7.1f}x"
        print(line)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
