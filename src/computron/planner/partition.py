"""Partitions of L layers into p contiguous pipeline stages.

What flows through: a cost table ``cost[s][k]`` = time of stage s when it holds k layers (inf
when k layers do not fit in its memory) goes in; a tuple of p layer counts summing to L comes
out (or None when nothing fits). Layers of one model are identical, so a partition is a list of
counts and contiguity is automatic.

numpy is imported inside the functions that use it, so that importing the planner (and building
the ``computron`` command line) stays quick.

- ``balanced``: equal counts, the remainder to the middle stages (Megatron's default).
- ``greedy``: water-filling for linear costs ``k * t_s + c_s``: every stage starts with one
  layer, each further layer goes where it raises that stage's time the least. Minimises the
  bottleneck for linear costs, ignoring everything else.
- ``exact``: dynamic program over any cost table; minimises the bottleneck, then, among the
  partitions with that bottleneck, the sum of stage times (a lexicographic optimum).
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

INF = math.inf


def balanced(L: int, p: int) -> tuple[int, ...] | None:
    """Equal counts; the ``L mod p`` extra layers go to the stages nearest the middle."""
    if p > L:
        return None
    base, r = divmod(L, p)
    order = sorted(range(p), key=lambda s: (abs(s - (p - 1) / 2), s))
    counts = [base] * p
    for s in order[:r]:
        counts[s] += 1
    return tuple(counts)


def greedy(L: int, t: list[float], c: list[float], caps: list[int]) -> tuple[int, ...] | None:
    """Water-filling: start at one layer per stage, add each next layer to the stage whose time
    ``(k+1)*t_s + c_s`` would be smallest, never above its memory cap ``caps[s]``."""
    p = len(t)
    if p > L or any(k < 1 for k in caps) or sum(min(k, L) for k in caps) < L:
        return None
    counts = [1] * p
    heap = [(2 * t[s] + c[s], s) for s in range(p) if caps[s] > 1]
    heapq.heapify(heap)
    for _ in range(L - p):
        if not heap:
            return None
        _, s = heapq.heappop(heap)
        counts[s] += 1
        if counts[s] < caps[s]:
            heapq.heappush(heap, ((counts[s] + 1) * t[s] + c[s], s))
    return tuple(counts)


def linear_costs(L: int, t: list[float], c: list[float], caps: list[int]) -> np.ndarray:
    """The cost table of linear stage times: ``cost[s][k] = k*t_s + c_s`` for 1 <= k <= caps[s]."""
    import numpy as np

    p = len(t)
    k = np.arange(L + 1, dtype=float)
    table = np.outer(np.ones(p), k) * np.asarray(t, dtype=float)[:, None] + np.asarray(c, dtype=float)[:, None]
    cols = np.arange(L + 1)[None, :]
    table[(cols < 1) | (cols > np.asarray(caps)[:, None])] = INF
    return table


def exact(cost: np.ndarray) -> tuple[int, ...] | None:
    """Lexicographic (bottleneck, then total) optimum over ``cost`` (shape p x (L+1)), by two DPs.

    Pass 1: ``f[s][j] = min_k max(f[s-1][j-k], cost[s][k])`` gives the best bottleneck T*.
    Pass 2: ``g[s][j] = min_k g[s-1][j-k] + cost[s][k]`` over stage costs <= T* gives the counts.
    O(p * L^2), vectorised over (j, k).
    """
    import numpy as np

    cost = np.asarray(cost, dtype=float)
    p, L1 = cost.shape
    L = L1 - 1
    if p > L:
        return None
    j = np.arange(L1)[:, None]
    k = np.arange(L1)[None, :]
    prev_idx = np.clip(j - k, 0, L)
    invalid = (k < 1) | (k > j)
    f = cost[0].copy()
    f[0] = INF
    for s in range(1, p):
        val = np.maximum(f[prev_idx], cost[s][None, :])
        val[invalid] = INF
        f = val.min(axis=1)
    best = f[L]
    if not math.isfinite(best):
        return None
    capped = np.where(cost <= best, cost, INF)
    g = capped[0].copy()
    g[0] = INF
    choice = np.zeros((p, L1), dtype=int)
    choice[0] = np.arange(L1)
    for s in range(1, p):
        val = g[prev_idx] + capped[s][None, :]
        val[invalid] = INF
        choice[s] = val.argmin(axis=1)
        g = val[np.arange(L1), choice[s]]
    if not math.isfinite(g[L]):
        return None
    counts = [0] * p
    rem = L
    for s in range(p - 1, -1, -1):
        kk = int(choice[s][rem]) if s else rem
        counts[s] = kk
        rem -= kk
    return tuple(counts)


def stage_times(cost: np.ndarray, counts) -> list[float]:
    """The stage times a partition gets from a cost table."""
    return [float(cost[s][k]) for s, k in enumerate(counts)]
