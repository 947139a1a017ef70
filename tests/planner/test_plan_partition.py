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
