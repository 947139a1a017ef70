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


def capped_min_max(L: int, w: list[float], caps: list[float], least: int = 1, c: list[float] | None = None) -> float:
    """Least bottleneck ``T`` of a fractional split of L layers with stage s taking ``n_s <= caps[s]``
    layers at ``w[s]`` seconds each plus ``c[s]`` fixed (and at least ``least`` layers): water-filling
    on ``n_s = (T - c_s) / w_s``; inf when the caps hold fewer than L layers."""
    p = len(w)
    c = c or [0.0] * p
    if sum(caps) < L or min(caps) < least:
        return math.inf
    floor = max(least * x + y for x, y in zip(w, c))
    order = sorted(range(p), key=lambda i: caps[i] * w[i] + c[i])
    left, inv, off = float(L), sum(1.0 / x for x in w), sum(y / x for x, y in zip(w, c))
    for i in order:
        t = (left + off) / inv
        if t <= caps[i] * w[i] + c[i]:
            return max(t, floor)
        left -= caps[i]
        inv -= 1.0 / w[i]
        off -= c[i] / w[i]
    return math.inf if left > 1e-9 else floor


def pipeline_min_max(L: int, w: list[float], caps: list[int], m: int, v: int, least: int = 1,
                     c: list[float] | None = None, rel_tol: float = 1e-3, cutoff: float = math.inf,
                     k: list[float] | None = None) -> float:
    """A bound on the pipeline time of every partition of L layers (stage s: ``n_s <= caps[s]``
    layers at ``w[s]`` seconds forward + backward and ``c[s]`` fixed, per micro-batch), the
    pipeline's fill and drain included.

    Every stage is busy ``m (n_s w_s + c_s)``. Under 1F1B (v=1), stage s cannot start before
    micro-batch 0 crossed the stages before it, runs at most ``min(p-s, m)`` forwards before its
    first backward, which waits for micro-batch 0 to cross every later stage and back, and its
    last backward must cross the earlier stages back: ``T >= W + n_s k_s`` with ``W = sum_j n_j w_j``
    and ``k_s = (m-1) w_s - (min(p-s, m) - 1) w_s/2`` (a forward is at most half of w). For
    uniform stages at s = p-1 this is the exact ``(m + p - 1)(F + B)``. Interleaved (v>1): the
    last stage's term only, ``sum_{j<p-1} n_j w_j / v + m (n_{p-1} w_{p-1} + c_{p-1})`` (a first
    chunk holds at least n/v layers). The least T over partitions in whole layers (the terms'
    caps rounded down; the work filled greedily) is bracketed by bisection; the value returned is
    never above it. With a ``cutoff`` that already fails, ``cutoff`` is returned at once (the least
    T is at least that); below it, 1% is precise enough (with ``rel_tol=inf``, only whether the
    cutoff is beaten). ``k`` replaces the per-stage fill terms (smaller ones give a weaker bound,
    e.g. one that holds whatever the stage order)."""
    p = len(w)
    c = c or [0.0] * p
    if sum(caps) < L or min(caps) < least:
        return math.inf
    lo = m * capped_min_max(L, w, [float(k) for k in caps], least, c)  # the busy terms alone
    if p == 1 or lo == math.inf:
        return lo
    if k is not None:
        pass
    elif v == 1:
        k = [(m - 1) * w[s] - (min(p - s, m) - 1) * w[s] / 2 for s in range(p)]
    else:
        k = [0.0] * (p - 1) + [m * w[-1] - w[-1] / v]
    wv = [x / v for x in w]
    order = sorted(range(p), key=wv.__getitem__)
    fixed = m * c[-1] if v > 1 else 0.0

    def least_work(box: list[float]) -> float:
        """Least sum n_s w_s/v with least <= n_s <= box[s] and sum n_s = L (inf if impossible)."""
        rem, work = L - least * p, least * sum(wv)
        for s in order:
            if rem <= 0:
                break
            take = min(box[s] - least, rem)
            work += take * wv[s]
            rem -= take
        return work if rem <= 1e-9 else math.inf

    def ok(T: float) -> bool:
        # a partition with work W must have n_s <= (T - fixed - W) / k_s: raise W to a fixed point
        U = [min(caps[s], math.floor((T / m - c[s]) / w[s] + 1e-9)) for s in range(p)]  # whole layers
        if min(U) < least:
            return False
        W = least_work(U)
        for _ in range(50):
            if W == math.inf:
                return False
            box = [min(U[s], math.floor((T - fixed - W) / k[s] + 1e-9)) if k[s] > 0 else U[s] for s in range(p)]
            if min(box) < least:
                return False
            W2 = least_work(box)
            if W2 <= W * (1 + 1e-9):
                return True
            W = W2
        return True

    if lo >= cutoff:
        return lo
    if cutoff < math.inf:
        if not ok(cutoff):
            return cutoff
        hi, rel_tol = cutoff, max(rel_tol, 0.01)  # it will be explored: the bound orders it only
        if hi - lo <= rel_tol * lo or ok(lo):
            return lo
    elif ok(lo):
        return lo
    else:
        hi = lo * 2
    while not ok(hi):
        hi *= 2
        if hi > lo * 1e6:
            return lo
    while hi - lo > rel_tol * lo:
        mid = (lo + hi) / 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return lo
