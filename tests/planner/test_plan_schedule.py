"""The 1F1B simulator against closed forms; in-flight counts; the lower bound."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from computron.planner.schedule import (chunk_peaks, first_chunk_from_order, first_chunk_inflight, inflight_closed_form,
                                        inflight_from_order, lower_bound, op_order, simulate)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
def test_uniform_1f1b_closed_form(p, m):
    F, B = 1.0, 2.5
    tl = simulate(p, 1, m, [F] * p, [B] * p)
    assert tl.makespan == pytest.approx((m + p - 1) * (F + B))
    assert tl.busy[0] == pytest.approx(m * (F + B))


@pytest.mark.parametrize("p,v,k", [(2, 2, 1), (2, 4, 3), (4, 2, 2), (4, 3, 1), (8, 2, 2), (8, 4, 1)])
def test_interleaved_bubble_is_p_minus_1_over_v(p, v, k):
    m, F, B = p * k, 1.0, 2.0
    tl = simulate(p, v, m, [F / v] * (p * v), [B / v] * (p * v))
    bubble = tl.makespan - m * (F + B)
    assert bubble == pytest.approx((p - 1) / v * (F + B))


def test_interleaved_needs_divisible_microbatches():
    with pytest.raises(ValueError, match="divisible"):
        op_order(4, 2, 6, 0)


@pytest.mark.parametrize("p,v,m", [(1, 1, 3), (4, 1, 2), (4, 1, 9), (3, 2, 6), (4, 2, 8), (4, 3, 12), (8, 2, 16)])
def test_inflight_closed_form_matches_op_order(p, v, m):
    for s in range(p):
        ops = op_order(p, v, m, s)
        assert len(ops) == 2 * m * v and len(set(ops)) == len(ops)
        assert inflight_closed_form(p, v, m, s) == inflight_from_order(ops)


@pytest.mark.parametrize("p,v,m", [(1, 1, 3), (4, 1, 2), (4, 1, 9), (3, 2, 6), (4, 2, 8), (4, 3, 12), (8, 2, 16),
                                   (8, 5, 8), (8, 5, 128), (2, 4, 2), (5, 3, 40)])
def test_first_chunk_inflight_matches_op_order(p, v, m):
    # the embedding's micro-batches on the first stage: all of them in 1F1B (min(p, m)), but
    # only 2p of the 2(p-1) + (v-1)p + 1 interleaved (chunk, micro-batch) pairs (16 of 47 at p=8, v=5)
    assert first_chunk_inflight(p, v, m) == first_chunk_from_order(op_order(p, v, m, 0))
    assert first_chunk_inflight(8, 5, 128) == 16 and inflight_closed_form(8, 5, 128, 0) == 47


def test_each_chunk_holds_its_own_micro_batches():
    # 1F1B: stage s holds min(p - s, m); interleaved, per chunk, summing to no less than the stage's peak
    assert [chunk_peaks(op_order(4, 1, 8, s)) for s in range(4)] == [{0: 4}, {1: 3}, {2: 2}, {3: 1}]
    assert chunk_peaks(op_order(4, 1, 2, 0)) == {0: 2}
    peaks = chunk_peaks(op_order(4, 2, 8, 1))
    assert peaks == {1: 8, 5: 4}  # chunk 1 takes all 8 before its first backward
    assert sum(peaks.values()) >= inflight_closed_form(4, 2, 8, 1) == 9


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 5), v=st.integers(1, 3), k=st.integers(1, 3), seed=st.integers(0, 10**6))
def test_lower_bound_never_exceeds_simulation(p, v, k, seed):
    if v > 1 and p == 1:
        v = 1
    m = p * k
    rnd = random.Random(seed)
    fwd = [rnd.uniform(0.1, 2) for _ in range(p * v)]
    bwd = [rnd.uniform(0.1, 4) for _ in range(p * v)]
    tl = simulate(p, v, m, fwd, bwd)
    assert lower_bound(p, v, m, fwd, bwd) <= tl.makespan + 1e-9
    assert all(f >= b - 1e-9 for f, b in zip(tl.finish, tl.busy))


def test_slow_stage_dominates():
    # one stage twice as slow: steady state runs at its pace
    p, m = 4, 32
    fwd, bwd = [1, 1, 2, 1], [2, 2, 4, 2]
    tl = simulate(p, 1, m, fwd, bwd)
    assert tl.makespan >= m * 6
    assert tl.makespan == pytest.approx(lower_bound(p, 1, m, fwd, bwd), rel=0.1)


@settings(max_examples=150, deadline=None)
@given(p=st.integers(1, 9), m=st.integers(1, 24), seed=st.integers(0, 10**6))
def test_slot_sweep_equals_event_simulation(p, m, seed):
    rnd = random.Random(seed)
    fwd = [rnd.uniform(0.1, 3) for _ in range(p)]
    bwd = [rnd.uniform(0.1, 5) for _ in range(p)]
    a = simulate(p, 1, m, fwd, bwd, fast=False)
    b = simulate(p, 1, m, fwd, bwd)
    assert b.finish == pytest.approx(a.finish) and b.first_start == pytest.approx(a.first_start)


def _torch_order(p: int, v: int, m: int, rank: int) -> list[tuple[int, int, int]]:
    """The forwards and backwards ``torch.distributed.pipelining``'s interleaved 1F1B (what ``computron
    train --virtual-stages`` runs) gives pipeline rank ``rank``, as ``op_order`` writes them (its idle
    slots left out: an op waits for its input either way)."""
    import types

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    sched = types.SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m,
                                  number_of_rounds=max(1, m // p))
    sched.microbatches_per_round = m // sched.number_of_rounds
    kind = {_ComputationType.FORWARD: 0, _ComputationType.FULL_BACKWARD: 1}
    return [(kind[a.computation_type], a.stage_index, a.microbatch_index)
            for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(sched, rank) if a is not None]


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (2, 2, 8), (2, 2, 16), (4, 2, 4), (4, 2, 8), (4, 2, 16),
                                   (4, 4, 8), (2, 3, 6)])
def test_interleaved_order_is_the_one_the_trainer_runs(p, v, m):
    """The planner prices the trainer's interleaved pipelines with Megatron's op order; the trainer runs
    torch's ``ScheduleInterleaved1F1B``. They agree, op for op, on every stage: a gap between the
    estimate and the measurement of an interleaved layout is in how the ops run, not in their order."""
    for s in range(p):
        assert _torch_order(p, v, m, s) == list(op_order(p, v, m, s)), s
