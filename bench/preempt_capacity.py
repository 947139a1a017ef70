"""A lower bound on the device time the hot/cold mix needs to meet its SLO, from the calibration alone.

Every policy runs one batch at a time on the one device, and a batch of a model serves only that
model's requests. A request of model m arriving at a with n output tokens is within the SLO only if
its prefill and n - 1 decode steps of m run in [a, a + k * solo_m] (k: the SLO scale; solo_m: the
latency of m's median request alone, as ``computron sim`` takes it). Requests whose windows do not
overlap share no step, so for any set of pairwise disjoint windows of one model, the steps of m are
at least the sum of their tokens; the heaviest such set (weighted interval scheduling) bounds m's
steps from below. Each step costs at least a decode step of one sequence (a prefill more), so

    busy >= sum over models of (steps_m * decode(1) + prefills_m * (prefill - decode))

which ignores swaps, KV memory and every request outside the disjoint set: a loose bound. A tighter
one counts every window: the fewest steps of m such that each window holds its tokens' worth
(``fewest_steps``, exact for one model alone), at a decode step each, plus the prefills of the
disjoint set. Neither counts a swap or the 1% of requests a 99% target may give up. Where ``busy /
duration`` exceeds 1, no policy serves every request in time. Prints both per total rate and writes
bench/results/preempt/capacity.json.

    PYTHONPATH=src python bench/preempt_capacity.py
"""

from __future__ import annotations

import bisect
import json
import math
import sys
from argparse import Namespace
from pathlib import Path

from computron.models import resolve_model
from computron.sim.costs import calibration
from computron.sim.layout import group_bytes
from computron.workload.args import workload_from_args

CAL = "bench/results/sim_validate/calibration_gpu.json"
NAMES = ["hot", "c1", "c2", "c3", "c4", "c5"]
SHARES = [10, 1, 1, 1, 1, 1]
RATES = [2, 4, 6, 7, 8, 10, 12, 14, 16, 24]
SCALE = 5.0


def heaviest_disjoint(windows: list[tuple[float, float, int]]) -> tuple[int, int]:
    """(tokens, count) of the heaviest set of pairwise disjoint windows (start, end, tokens)."""
    windows = sorted(windows, key=lambda w: w[1])
    ends = [w[1] for w in windows]
    best = [(0, 0)] * (len(windows) + 1)
    for i, (a, _, n) in enumerate(windows):
        j = bisect.bisect_left(ends, a, 0, i)  # windows ending before this one starts
        take = (best[j][0] + n, best[j][1] + 1)
        best[i + 1] = max(best[i], take)
    return best[-1]


def fewest_steps(windows: list[tuple[float, float, int]], step: float) -> int:
    """The fewest decode steps of one model (``step`` seconds each, one at a time) such that every
    window (start, end, tokens) holds at least ``tokens`` of them: on a grid of ``step``, windows by
    their end, each given what it lacks in the latest free slots it holds (a step serves every
    window it lies in, so placing late serves the most later windows; exact for windows on a line)."""
    used: list[int] = []  # sorted slots
    taken: set[int] = set()
    for a, d, n in sorted(windows, key=lambda w: w[1]):
        lo, hi = math.ceil(a / step), math.floor(d / step)
        have = bisect.bisect_right(used, hi) - bisect.bisect_left(used, lo)
        slot = hi
        while have < n and slot >= lo:
            if slot not in taken:
                taken.add(slot)
                bisect.insort(used, slot)
                have += 1
            slot -= 1
    return len(used)


def main() -> int:
    cal = calibration(CAL)
    cfg, _ = resolve_model("opt-1.3b")
    nbytes = sum(group_bytes(cfg))
    prefill, decode = cal.prefill_time(nbytes, 272), cal.decode_time(nbytes, 1)
    rows = []
    for rate in RATES:
        rates = [rate * s / sum(SHARES) for s in SHARES]
        args = Namespace(trace=None, rates=",".join(map(str, rates)), rate=None, duration=120.0, cv=2.0, skew=0.0,
                         prompt="32:512", output="16:256", seed=0, process="gamma",
                         start="stationary")  # as `computron sim` builds it
        trace = workload_from_args(args, NAMES)
        arrivals = list(trace)
        busy, steps, fewest, prefills = 0.0, 0, 0, 0
        for name in NAMES:
            mine = [a for a in arrivals if a.model == name]
            if not mine:
                continue
            p = sorted(a.prompt_tokens for a in mine)[len(mine) // 2]
            o = sorted(a.output_tokens for a in mine)[len(mine) // 2]
            solo = cal.prefill_time(nbytes, p) + (o - 1) * decode
            windows = [(a.time, a.time + SCALE * solo, a.output_tokens) for a in mine]
            tokens, count = heaviest_disjoint(windows)
            steps += tokens
            busy += tokens * decode + count * (prefill - decode)
            fewest += fewest_steps(windows, decode)
            prefills += count
        end = max(a.time for a in arrivals)
        tight = fewest * decode + prefills * (prefill - decode)
        rows.append({"rate": rate, "requests": len(arrivals), "steps_lower_bound": steps, "busy_s_lower_bound": busy,
                     "duration_s": end, "utilisation_lower_bound": busy / end, "fewest_steps": fewest,
                     "busy_s_fewest_steps": tight, "utilisation_fewest_steps": tight / end})
        print(f"{rate:>5} req/s: {len(arrivals):>5} requests; disjoint windows: >= {steps:>6} steps, busy >= "
              f"{busy:6.1f} s of {end:5.1f} s ({busy / end * 100:5.1f}%); every window: >= {fewest:>6} steps, "
              f"busy >= {tight:6.1f} s ({tight / end * 100:5.1f}%)")
    out = Path("bench/results/preempt/capacity.json")
    out.write_text(json.dumps({"calibration": CAL, "model_bytes": nbytes, "decode_s": decode, "prefill_s": prefill,
                               "slo_scale": SCALE, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
