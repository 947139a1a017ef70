"""Pipeline schedules (1F1B and interleaved 1F1B), simulated operation by operation.

What flows through: p stages, v model chunks per stage (v=1: plain 1F1B), m micro-batches and,
per global chunk c (chunk c = j*p + s runs on stage s = c mod p), the duration of one forward
op ``fwd[c]`` and one backward op ``bwd[c]`` (including the blocking send of its output).
Out comes each stage's finish time and busy time.

Rules (Megatron-LM semantics): each stage runs its ops in a fixed order (``op_order``); forward
of (c, i) needs forward of (c-1, i) done, backward of (c, i) needs backward of (c+1, i), and the
last chunk's backward needs its own forward. An op starts when both its stage is free and its
input has arrived. Closed forms the tests check: uniform stages give ``(m + p - 1) * (F + B)``;
the interleaved bubble is ``(p - 1) / v`` stage-op pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@lru_cache(maxsize=256)
def op_order(p: int, v: int, m: int, s: int) -> tuple[tuple[int, int, int], ...]:
    """The ops of stage ``s`` in execution order: ``(kind, global_chunk, microbatch)``, kind 0=F 1=B.

    v=1 (PipeDream-Flush / 1F1B): ``min(p-s-1, m)`` warm-up forwards, then alternate one forward
    and one backward, then drain the backwards.
    v>1 (Megatron interleaved): forwards walk micro-batches in groups of p through chunks 0..v-1;
    warm-up is ``2*(p-s-1) + (v-1)*p`` forwards (capped at m*v); needs m divisible by p.
    """
    if v == 1:
        w = min(p - s - 1, m)
        ops = [(0, s, i) for i in range(w)]
        for i in range(m - w):
            ops.append((0, s, w + i))
            ops.append((1, s, i))
        ops.extend((1, s, i) for i in range(m - w, m))
        return tuple(ops)
    if m % p:
        raise ValueError(f"interleaved schedule needs micro-batches ({m}) divisible by pipeline stages ({p})")
    total = m * v

    def fwd(k):
        j = (k // p) % v
        return (0, j * p + s, (k // (p * v)) * p + k % p)

    def bwd(k):
        j = v - 1 - (k // p) % v
        return (1, j * p + s, (k // (p * v)) * p + k % p)

    w = min(2 * (p - s - 1) + (v - 1) * p, total)
    ops = [fwd(k) for k in range(w)]
    for k in range(total - w):
        ops.append(fwd(w + k))
        ops.append(bwd(k))
    ops.extend(bwd(k) for k in range(total - w, total))
    return tuple(ops)


def inflight_closed_form(p: int, v: int, m: int, s: int) -> int:
    """Peak number of (chunk, micro-batch) activations stage s holds: ``min(p - s, m)`` for 1F1B,
    ``min(2*(p-s-1) + (v-1)*p + 1, m*v)`` interleaved."""
    if v == 1:
        return min(p - s, m)
    return min(2 * (p - s - 1) + (v - 1) * p + 1, m * v)


def first_chunk_inflight(p: int, v: int, m: int) -> int:
    """Peak number of micro-batches the first stage holds in its first model chunk (the one with
    the embedding): ``min(p, m)`` for 1F1B; interleaved ``min(2p, m)``: the warm-up walks p
    micro-batches through all v chunks, then starts the next p on chunk 0, and chunk 0's first
    backward comes only after all p of those have run forward."""
    return min(p, m) if v == 1 else min(2 * p, m)


def chunk_peaks(ops) -> dict[int, int]:
    """Per model chunk, the peak of its (#forwards - #backwards) along an op order: the micro-batches
    it holds between forward and backward at most (a graphed stage's slots, ``train/stage_graphs.py``)."""
    cur: dict[int, int] = {}
    peak: dict[int, int] = {}
    for kind, chunk, _ in ops:
        cur[chunk] = cur.get(chunk, 0) + (1 if kind == 0 else -1)
        peak[chunk] = max(peak.get(chunk, 0), cur[chunk])
    return peak


@lru_cache(maxsize=4096)
def graph_slots(p: int, v: int, m: int, s: int) -> tuple[int, int, int]:
    """A graphed pipeline stage's slots (``train/stage_graphs.py``: one graph per micro-batch a chunk
    holds at once, each with memory of its own): (all its chunks', its first chunk's, its last chunk's).
    Interleaved, the sum is above the stage's in-flight peak: the chunks peak at different times."""
    peaks = chunk_peaks(op_order(p, v, m, s))
    return sum(peaks.values()), peaks.get(s, 0), peaks.get((v - 1) * p + s, 0)


def first_chunk_from_order(ops) -> int:
    """Peak of chunk 0's (#forwards - #backwards) along stage 0's op order."""
    return chunk_peaks(ops).get(0, 0)


def inflight_from_order(ops) -> int:
    """Peak of (#forwards - #backwards) along an op order (what the closed form must equal)."""
    peak = cur = 0
    for kind, _, _ in ops:
        cur += 1 if kind == 0 else -1
        peak = max(peak, cur)
    return peak


@dataclass(frozen=True)
class Timeline:
    """Result of one simulation: per stage, when its last op ends, its busy time and its first start."""

    finish: tuple[float, ...]
    busy: tuple[float, ...]
    first_start: tuple[float, ...]

    @property
    def makespan(self) -> float:
        return max(self.finish)


def _slot_op(p: int, m: int, s: int, k: int) -> tuple[int, int]:
    """(kind, micro-batch) of the k-th op of stage s under 1F1B (the inverse of op_order)."""
    w = min(p - s - 1, m)
    if k < w:
        return 0, k
    if k < 2 * m - w:
        j = k - w
        return (0, w + j // 2) if j % 2 == 0 else (1, j // 2)
    return 1, k - m


def _slot_of(p: int, m: int, s: int, kind: int, i: int) -> int:
    """Position of op (kind, i) in stage s's 1F1B order."""
    w = min(p - s - 1, m)
    if kind == 0:
        return i if i < w else 2 * i - w
    return w + 2 * i + 1 if i < m - w else m + i


def sweep_1f1b(p: int, m: int, fwd: list[float], bwd: list[float]) -> Timeline:
    """Exact 1F1B simulation, slot by slot (same result as :func:`simulate` with v=1, faster).

    Every op's input comes from the neighbouring stage's op at the same slot k or at k-1, so
    slot k is done forwards by ascending stage and backwards by descending stage. In the steady
    slots (p-1 <= k < 2m-p+1) every input comes from slot k-1 of the neighbour, so all stages
    advance at once: ``x_k[s] = max(x_{k-1}[s], x_{k-1}[s -/+ 1]) + d_s`` (numpy over stages).
    """
    import numpy as np

    free = [0.0] * p
    first = [0.0] * p
    lo, hi = p - 1, 2 * m - (p - 1)

    def slot(k: int) -> None:
        prev = free[:]
        for s in range(p):  # forwards, ascending
            kind, i = _slot_op(p, m, s, k)
            if kind == 0:
                t = free[s]
                if s:
                    src = free if _slot_of(p, m, s - 1, 0, i) == k else prev
                    t = max(t, src[s - 1])
                if k == 0:
                    first[s] = t
                free[s] = t + fwd[s]
        for s in range(p - 1, -1, -1):  # backwards, descending
            kind, i = _slot_op(p, m, s, k)
            if kind == 1:
                t = free[s]
                if s < p - 1:
                    src = free if _slot_of(p, m, s + 1, 1, i) == k else prev
                    t = max(t, src[s + 1])
                free[s] = t + bwd[s]

    k = 0
    while k < min(lo, 2 * m):
        slot(k)
        k += 1
    if k < hi:
        x = np.array(free)
        f, b = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
        w = np.array([min(p - s - 1, m) for s in range(p)])
        is_f = [((q - w) % 2 == 0) for q in (0, 1)]  # by slot parity: which stages run a forward
        dur = [np.where(mask, f, b) for mask in is_f]
        idx = np.arange(p)
        nbr = [np.where(mask, np.maximum(idx - 1, 0), np.minimum(idx + 1, p - 1)) for mask in is_f]
        for kk in range(k, hi):
            q = kk % 2
            x = np.maximum(x, x[nbr[q]]) + dur[q]
        free = x.tolist()
        k = hi
    while k < 2 * m:
        slot(k)
        k += 1
    busy = tuple(m * (fwd[s] + bwd[s]) for s in range(p))
    return Timeline(tuple(free), busy, tuple(first))


def simulate(p: int, v: int, m: int, fwd: list[float], bwd: list[float], fast: bool = True) -> Timeline:
    """Run the schedule op by op; ``fwd``/``bwd`` hold one duration per global chunk (p*v of them).

    Each stage advances through its op order; an op whose input is not ready parks the stage on
    that input, and the input's completion wakes it. Deterministic durations make this an exact
    event-driven simulation of the synchronous pipeline. For v=1 (unless ``fast=False``) the
    equivalent slot sweep :func:`sweep_1f1b` is used.
    """
    C = p * v
    if len(fwd) != C or len(bwd) != C:
        raise ValueError(f"need {C} forward and backward durations, got {len(fwd)} and {len(bwd)}")
    if v == 1 and fast:
        return sweep_1f1b(p, m, fwd, bwd)
    orders = [op_order(p, v, m, s) for s in range(p)]
    end = [-1.0] * (2 * C * m)
    waiting: dict[int, int] = {}
    ptr = [0] * p
    free = [0.0] * p
    first = [-1.0] * p
    stack = list(range(p - 1, -1, -1))
    last = C - 1
    while stack:
        s = stack.pop()
        ops = orders[s]
        k, t, n = ptr[s], free[s], len(ops)
        while k < n:
            kind, c, i = ops[k]
            if kind == 0:
                dep = (c - 1) * m + i if c else -1
                dur = fwd[c]
            else:
                dep = c * m + i if c == last else (C + c + 1) * m + i
                dur = bwd[c]
            if dep >= 0:
                de = end[dep]
                if de < 0:
                    waiting[dep] = s
                    break
                if de > t:
                    t = de
            if first[s] < 0:
                first[s] = t
            t += dur
            key = (kind * C + c) * m + i
            end[key] = t
            w = waiting.pop(key, None)
            if w is not None:
                stack.append(w)
            k += 1
        ptr[s], free[s] = k, t
    if any(ptr[s] != len(orders[s]) for s in range(p)):
        raise RuntimeError("pipeline schedule deadlocked (inconsistent op order)")
    busy = tuple(m * sum(fwd[c] + bwd[c] for c in range(s, C, p)) for s in range(p))
    return Timeline(tuple(free), busy, tuple(first))


def lower_bound(p: int, v: int, m: int, fwd: list[float], bwd: list[float]) -> float:
    """A cheap bound the simulated makespan never beats (used to prune the search).

    Stage s cannot start before micro-batch 0 crossed chunks 0..s-1, is busy m*sum(F+B) of its
    chunks, and its last backward (chunk s) must then cross chunks s-1..0:
    ``max_s  sum_{j<s} F_j + busy_s + sum_{j<s} B_j``.
    """
    C = p * v
    best = 0.0
    pre_f = pre_b = 0.0
    for s in range(p):
        busy = m * sum(fwd[c] + bwd[c] for c in range(s, C, p))
        best = max(best, pre_f + busy + pre_b)
        pre_f += fwd[s]
        pre_b += bwd[s]
    return best
