"""Tables of the model-parallel runs (``bench/gpu_multi.sh``) from their JSON, in Markdown.

1. aggregate swap-in of OPT-13B by layout against the concurrent raw pinned memcpy of the same
   shards measured in the same run, and against tp=1;
2. the round-robin experiment (2 copies of OPT-13B, 24 blocking requests) by layout, both policies,
   beside the original Computron's published means (4xA100, PCIe 4.0; ../shared/BENCHMARKS.md), with
   the load-time speed-up over the one-GPU layout of the same run;
3. the striped swap-in of a one-GPU model (``bench/striped_swap.py``) on k GPUs against one link's raw
   memcpy and k links' concurrent memcpy of the same run.

    python3 bench/multi_report.py [bench/results/multi_h200x4]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2)]
# (tp, pp): offload, load, response means in seconds, as published for the original system
PUBLISHED = {(1, 1): (1.238, 1.350, 1.408), (2, 1): (0.632, 0.732, 0.801), (4, 1): (0.447, 0.689, 0.761),
             (1, 2): (0.621, 0.858, 0.924), (1, 4): (0.380, 0.645, 0.722), (2, 2): (0.318, 0.423, 0.502)}


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def swap_table(root: Path) -> list[str]:
    rows, base = [], None
    for tp, pp in LAYOUTS:
        f = root / f"swap_opt-13b_tp{tp}_pp{pp}.json"
        if not f.exists():
            continue
        r = json.loads(f.read_text())["models"]["opt-13b"]
        raw, swap = statistics.median(r["raw_memcpy_s"]), statistics.median(r["swap_in_s"])
        base = swap if (tp, pp) == (1, 1) else base
        rows.append(f"| tp={tp} pp={pp} | {r['bytes'] / 1e9:.2f} GB | {_ms(raw)} ms | {_ms(swap)} ms | "
                    f"{r['bytes'] / swap / 1e9:.1f} GB/s | {raw / swap:.1%} | "
                    + (f"{swap / base:.3f} |" if base else "- |"))
    head = ["| layout | bytes (all ranks) | concurrent raw memcpy | swap-in | aggregate | swap / raw | "
            "swap-in / tp=1's |", "| --- | --- | --- | --- | --- | --- | --- |"]
    return head + rows


def round_robin_table(root: Path) -> list[str]:
    rows, base = [], None
    for tp, pp in LAYOUTS:
        f = root / f"round_robin_opt-13b_tp{tp}_pp{pp}_n2_r24_blocking.json"
        if not f.exists():
            continue
        pol = json.loads(f.read_text())["policies"]
        d, c = pol["default"]["times_s"], pol["computron"]["times_s"]
        base = d["load"]["mean"] if (tp, pp) == (1, 1) else base
        off, load, resp = PUBLISHED[(tp, pp)]
        rows.append(
            f"| ({tp},{pp}) | {d['load']['mean']:.3f} / {d['response']['mean']:.3f} / {d['response']['p99']:.3f} | "
            f"{c['evict']['mean']:.3f} / {c['load']['mean']:.3f} / {c['response']['mean']:.3f} / "
            f"{c['response']['p99']:.3f} | " + (f"{base / d['load']['mean']:.2f}x" if base else "-") +
            f" | {off:.3f} / {load:.3f} / {resp:.3f} |")
    head = ["| (tp,pp) | default: load / response mean / p99 | computron: evict / load / response mean / p99 | "
            "default load, speed-up over (1,1) | published (4xA100): offload / load / response |",
            "| --- | --- | --- | --- | --- |"]
    return head + rows


def striped_table(root: Path) -> list[str]:
    f = root / "striped_swap.json"
    if not f.exists():
        return []
    med, rows = statistics.median, []
    for r in json.loads(f.read_text())["runs"]:
        one, k = med(r["raw_one_link_s"]), med(r["raw_k_links_s"])
        swaps = [("plain", med(r["plain_swap_s"]), med(r["plain_first_group_s"]), r["plain_bytes_equal"])]
        swaps += [(f"striped, {c} MiB chunks", med(s["swap_s"]), med(s["first_group_s"]),
                   s["bytes_equal"] and s["staging_held_after"] == 0) for c, s in r["striped"].items()]
        for name, t, first, ok in swaps:
            rows.append(f"| {r['gpus']} | {name} | {_ms(t)} ms | {_ms(one)} ms | {_ms(k)} ms | {one / t:.2f}x | "
                        f"{k / t:.1%} | {_ms(first)} ms | {'yes' if ok else 'NO'} |")
    return ["| GPUs | swap-in | time | one link, raw | k links at once, raw | speed-up over one link | "
            "of k links | first layer group in | bytes equal, staging returned |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"] + rows


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "bench/results/multi_h200x4")
    if not root.is_dir():
        print(f"no such directory: {root}", file=sys.stderr)
        return 2
    print("\n".join(["Aggregate swap-in, OPT-13B (medians of 5):", ""] + swap_table(root) +
                     ["", "Round-robin, 2 copies of OPT-13B, 24 blocking requests (seconds):", ""] +
                     round_robin_table(root) +
                     ["", "Striped swap-in of OPT-13B onto GPU 0 (medians of 5):", ""] + striped_table(root)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
