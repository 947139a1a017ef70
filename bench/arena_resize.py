"""How fast the arena hands memory over (colocation): the seconds to shrink it by S bytes
(memory returned to the driver) and to grow it back, for S in 1, 4 and 16 GiB (median of
``--repeats``), with the driver's free memory checked after each; beside them, in the same run,
what a plain allocation of S bytes costs to release and take again through PyTorch's allocator
(``del`` + ``empty_cache``, then ``torch.empty``).

    python bench/arena_resize.py [--max 20GiB] [--repeats 5]

Writes bench/results/arena_resize_<gpu>.json and prints a table (GPU only).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from computron.config import parse_bytes  # noqa: E402
from computron.memory.arena import Arena  # noqa: E402

GiB = 2**30


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max", default="20GiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    top = parse_bytes(args.max)
    arena = Arena(top, "cuda")
    keep = arena.allocate(GiB, "weights", "resident")  # something stays, as a model would
    rows = []
    for size in (1 * GiB, 4 * GiB, 16 * GiB):
        if size > top - GiB:
            continue
        shrink, grow, freed, plain_free, plain_take = [], [], [], [], []
        for _ in range(args.repeats):
            before = torch.cuda.mem_get_info()[0]
            shrink.append(timed(lambda: arena.resize(top - size)))
            freed.append(torch.cuda.mem_get_info()[0] - before)
            grow.append(timed(lambda: arena.resize(top)))
            buf = [torch.empty(size, dtype=torch.uint8, device="cuda")]
            plain_free.append(timed(lambda: (buf.clear(), torch.cuda.empty_cache())))
            plain_take.append(timed(lambda: buf.append(torch.empty(size, dtype=torch.uint8, device="cuda"))))
            buf.clear()
            torch.cuda.empty_cache()
        rows.append({"bytes": size, "shrink_s": statistics.median(shrink), "grow_s": statistics.median(grow),
                     "freed_bytes": statistics.median(freed), "plain_release_s": statistics.median(plain_free),
                     "plain_take_s": statistics.median(plain_take), "runs": {"shrink_s": shrink, "grow_s": grow}})
    arena.release(keep)
    name = torch.cuda.get_device_name()
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-").split("-")[0]
    out = Path(args.out or f"bench/results/arena_resize_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": name, "arena_bytes": top, "chunk_bytes": arena._vmm.chunk if arena._vmm else None,
                               "repeats": args.repeats, "rows": rows}, indent=1))
    print(f"{'GiB':>5} {'shrink ms':>10} {'grow ms':>9} {'freed GiB':>10} {'plain free ms':>14} {'plain take ms':>14}")
    for r in rows:
        print(f"{r['bytes'] / GiB:>5.0f} {r['shrink_s'] * 1e3:>10.2f} {r['grow_s'] * 1e3:>9.2f} "
              f"{r['freed_bytes'] / GiB:>10.2f} {r['plain_release_s'] * 1e3:>14.2f} {r['plain_take_s'] * 1e3:>14.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
