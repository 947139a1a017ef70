"""Partitioners: the exact DP against brute force, greedy against the DP, balanced by hand."""

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from computron.planner import partition


def brute_force(cost):
    p, L1 = cost.shape
    best, arg = None, None
    for cuts in itertools.combinations(range(1, L1 - 1), p - 1):
        counts = [b - a for a, b in zip((0,) + cuts, cuts + (L1 - 1,))]
        times = [cost[s][k] for s, k in enumerate(counts)]
        key = (max(times), sum(times))
        if math.isfinite(key[0]) and (best is None or key < best):
            best, arg = key, tuple(counts)
    return best, arg


@settings(max_examples=80, deadline=None)
@given(p=st.integers(1, 4), L=st.integers(1, 9), seed=st.integers(0, 10**6), holes=st.booleans())
def test_exact_matches_brute_force(p, L, seed, holes):
    rnd = random.Random(seed)
    cost = np.array([[rnd.choice([1, 2, 3, 5, 8]) * (k + rnd.random()) for k in range(L + 1)] for _ in range(p)])
    if holes:  # memory caps and arbitrary infeasible cells
        for s in range(p):
            cost[s][rnd.randint(1, L):] = math.inf
    cost[:, 0] = math.inf
    expect, _ = brute_force(cost) if p <= L else (None, None)
    got = partition.exact(cost)
    if expect is None:
        assert got is None
    else:
        times = partition.stage_times(cost, got)
        assert sum(got) == L and min(got) >= 1
        assert (max(times), sum(times)) == pytest.approx(expect)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 5), L=st.integers(5, 30), seed=st.integers(0, 10**6))
def test_greedy_reaches_the_optimal_bottleneck_for_linear_costs(p, L, seed):
    rnd = random.Random(seed)
    t = [rnd.uniform(0.5, 3) for _ in range(p)]
    c = [rnd.uniform(0, 2) for _ in range(p)]
    caps = [rnd.randint(min(L, L // p + 1), L) for _ in range(p)]
    table = partition.linear_costs(L, t, c, caps)
    ex, gr = partition.exact(table), partition.greedy(L, t, c, caps)
    assert gr is not None and ex is not None
    assert all(1 <= k <= cap for k, cap in zip(gr, caps)) and sum(gr) == L
    assert max(partition.stage_times(table, gr)) == pytest.approx(max(partition.stage_times(table, ex)))


def test_balanced_by_hand():
    assert partition.balanced(48, 4) == (12, 12, 12, 12)
    assert partition.balanced(10, 4) == (2, 3, 3, 2)
    assert partition.balanced(3, 4) is None


def test_heterogeneous_speeds_get_proportional_layers():
    # stage 0 twice as fast: it should take about twice the layers
    table = partition.linear_costs(48, [1.0, 2.0], [0.0, 0.0], [48, 48])
    assert partition.exact(table) == (32, 16)


def test_infeasible_memory_caps():
    assert partition.greedy(10, [1, 1], [0, 0], [4, 4]) is None
    assert partition.exact(partition.linear_costs(10, [1, 1], [0, 0], [4, 4])) is None


def _all_partitions(L, p, caps, least):
    if p == 1:
        if least <= L <= caps[0]:
            yield (L,)
        return
    for k in range(least, min(caps[0], L) + 1):
        for rest in _all_partitions(L - k, p - 1, caps[1:], least):
            yield (k,) + rest


@pytest.mark.parametrize("v", [1, 2])
def test_pipeline_min_max_never_above_a_simulated_schedule(v):
    """The search prunes with this bound: it must not exceed the simulated time of any partition
    (random stages, forward a third of each layer's time, fixed costs split over the chunks)."""
    from computron.planner.partition import pipeline_min_max
    from computron.planner.schedule import simulate

    rng = random.Random(7 + v)
    ratios = []
    for _ in range(150):
        p = rng.randint(2, 4)
        m = p * rng.randint(1, 3) if v > 1 else rng.randint(1, 8)
        L = rng.randint(p * v, 12)
        w = [rng.uniform(0.5, 3.0) for _ in range(p)]
        c = [rng.uniform(0.0, 1.0) for _ in range(p)]
        caps = [rng.randint(v, L) for _ in range(p)]
        bound = pipeline_min_max(L, w, caps, m, v, v, c)
        best = math.inf
        for counts in _all_partitions(L, p, caps, v):
            fwd, bwd = [0.0] * (p * v), [0.0] * (p * v)
            for s, n in enumerate(counts):
                q, r = divmod(n, v)
                for j in range(v):
                    k = q + (1 if j < r else 0)
                    fwd[j * p + s] = k * w[s] / 3 + c[s] / (2 * v)
                    bwd[j * p + s] = k * w[s] * 2 / 3 + c[s] / (2 * v)
            best = min(best, simulate(p, v, m, fwd, bwd).makespan)
        if best == math.inf:
            assert bound == math.inf
            continue
        assert bound <= best * (1 + 1e-9)
        busy = m * partition.capped_min_max(L, w, caps, v, c)  # the bound without fill and drain
        assert bound >= busy * (1 - 1e-9)
        ratios.append((busy / best, bound / best))
    # the fill and drain close much of the gap to the simulated optimum
    assert sum(b for _, b in ratios) / len(ratios) > sum(a for a, _ in ratios) / len(ratios) + 0.05
