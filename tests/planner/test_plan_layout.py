"""Placements, rank layout and the bandwidth each stage sees."""

import math
from collections import Counter

import pytest

from computron.parallel.dims import ParallelDims
from computron.planner.costs import Assumptions
from computron.planner.hardware import parse_compact
from computron.planner.layout import compositions, distinct_orderings, parse_placement, placement_text, stage_envs

A = Assumptions()


def test_distinct_orderings_are_all_multiset_permutations():
    got = distinct_orderings({"a": 2, "b": 2})
    assert len(got) == len(set(got)) == math.factorial(4) // (2 * 2)
    assert ("a", "b", "a", "b") in got  # not a rotation of aabb
    got = distinct_orderings({"x": 3, "y": 2, "z": 1})
    assert len(got) == len(set(got)) == math.factorial(6) // (6 * 2)
    assert all(Counter(o) == Counter({"x": 3, "y": 2, "z": 1}) for o in got)


def test_compositions():
    cl = parse_compact("a100-80gb:8x2,v100:8x1")
    assert len(compositions(cl, all_nodes=False)) == 3 * 2 - 1
    assert compositions(cl, all_nodes=True) == [{"a100-80gb": 2, "v100": 1}]


def test_stage_envs_bandwidths():
    cl = parse_compact("a100-80gb:8x2")
    a100 = cl.node_types[0]
    placement = (a100, a100)
    # tp=8 dp=1 pp=2: each stage is one node; p2p crosses nodes on one NIC per GPU
    envs = stage_envs(placement, ParallelDims(dp=1, tp=8, pp=2), A)
    assert envs[0].next_crosses and envs[0].next_bw == pytest.approx(25e9 * A.inter_eff)
    # tp=1 dp=16 pp=1: the DP ring spans two nodes with 8 members each -> 8 NICs
    (env,) = stage_envs(placement, ParallelDims(dp=16, tp=1, pp=1), A)
    assert env.dp_bw == pytest.approx(min(8 * 25e9 * A.inter_eff, 300e9 * A.intra_eff))
    # tp=8 dp=2 pp=1: 8 rings of 2 members, one per node -> one NIC each
    (env,) = stage_envs(placement, ParallelDims(dp=2, tp=8, pp=1), A)
    assert env.dp_bw == pytest.approx(25e9 * A.inter_eff) and env.dp_latency == A.inter_latency_s
    # tp=1 dp=8 pp=2: a ring inside one node
    envs = stage_envs(placement, ParallelDims(dp=8, tp=1, pp=2), A)
    assert envs[0].dp_bw == pytest.approx(300e9 * A.intra_eff)


def test_mixed_stage_is_costed_by_its_slowest_link():
    cl = parse_compact("a100-80gb:8x1,a10:4x2")
    a100, a10 = cl.node_types
    envs = stage_envs((a100, a10, a10), ParallelDims(dp=4, tp=2, pp=2), A)
    assert {n.gpu.name for n in envs[0].nodes} == {"a100-80gb"}
    assert {n.gpu.name for n in envs[1].nodes} == {"a10"}
    assert envs[1].dp_bw == pytest.approx(min(2 * a10.nic_per_gpu * A.inter_eff, a10.intra_bw * A.intra_eff))


def test_placement_text_roundtrip():
    cl = parse_compact("a100-80gb:8x2,v100:8x2")
    p = parse_placement("a100-80gb,v100*2,a100-80gb", cl)
    assert placement_text(p) == "a100-80gb,v100*2,a100-80gb"
    with pytest.raises(ValueError, match="cluster has 2"):
        parse_placement("v100*3", cl)


def test_context_parallel_rings_in_the_rank_layout():
    cl = parse_compact("a100-80gb:8x2")
    a100 = cl.node_types[0]
    # tp=2 cp=4: a context group is 4 consecutive TP groups, inside one node
    (env,) = stage_envs((a100, a100), ParallelDims(dp=2, tp=2, pp=1, cp=4), A)
    assert env.cp_bw == pytest.approx(300e9 * A.intra_eff) and env.cp_latency == A.intra_latency_s
    # gradients are reduced over the dp*cp = 8 ranks of a TP shard: 4 on each node -> 4 NICs
    assert env.dp_bw == pytest.approx(4 * 25e9 * A.inter_eff)
    # tp=8 cp=2: the context ring joins the two nodes, one NIC per member
    (env,) = stage_envs((a100, a100), ParallelDims(dp=1, tp=8, pp=1, cp=2), A)
    assert env.cp_bw == pytest.approx(25e9 * A.inter_eff) and env.cp_latency == A.inter_latency_s
    # tp=2 cp=8: 4 ring members on each node, but a step's blocks cross between the nodes on one
    # GPU's NIC share: the crossing link sets the step
    (env,) = stage_envs((a100, a100), ParallelDims(dp=1, tp=2, pp=1, cp=8), A)
    assert env.cp_bw == pytest.approx(25e9 * A.inter_eff)
    with pytest.raises(ValueError, match="tp\\*cp\\*dp\\*pp = 32"):
        stage_envs((a100, a100), ParallelDims(dp=2, tp=8, pp=1, cp=2), A)


def test_context_parallelism_needs_fused_attention_and_even_chunks():
    from computron.planner.layout import check_dims
    from computron.planner.model import preset

    with pytest.raises(ValueError, match="fused attention"):
        check_dims(preset("gpt3-13b"), ParallelDims(tp=1, cp=2), [8])
    m = preset("llama-3-8b")
    check_dims(m, ParallelDims(tp=1, cp=4), [8])
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        check_dims(m, ParallelDims(tp=1, cp=3), [8])
    assert ParallelDims(dp=2, tp=2, pp=2, cp=2).world_size == 16 and str(ParallelDims(cp=2)).endswith("cp=2")
