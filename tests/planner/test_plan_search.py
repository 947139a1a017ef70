"""Search: feasibility, exactness of branch and bound, objectives, speed."""

import itertools
import math
import time
from dataclasses import replace

import pytest

from computron.parallel.dims import ParallelDims
from computron.planner.errors import PlannerError
from computron.planner.estimate import CostModel, PlanConfig, PlanContext
from computron.planner.hardware import parse_compact
from computron.planner.layout import distinct_orderings, stage_envs
from computron.planner.model import TransformerShape, preset
from computron.planner.partition import capped_min_max
from computron.planner.search import SearchOptions, _layouts, block_orderings, divisors, search

SMALL = TransformerShape("small", "gpt", layers=8, hidden=1024, heads=16, ffn=4096, vocab=32000, seq_len=1024, global_batch=32)
LONG = TransformerShape("long", "llama", layers=16, hidden=4096, heads=32, ffn=11008, vocab=32000, seq_len=16384,
                        global_batch=8, kv_heads=8, dtype="bfloat16")


def brute_force(m, cluster, opts):
    """Simulate every plan the search could return (all placements, dims with cp, mbs, v, methods),
    keeping for each configuration the first memory rung with which it fits: ZeRO stages 1, 2, 3
    (or those asked for; 0 with a single rank per shard) with no recomputation, then with selective
    (tried with fused attention too), then full (or the recomputation asked for); sorted times."""
    cm = CostModel(m)
    comp = {n.name: n.count for n in cluster.node_types}
    nts = {n.name: n for n in cluster.node_types}
    times = {}
    gpus = cluster.total_gpus
    for order in distinct_orderings(comp):
        placement = tuple(nts[x] for x in order)
        if opts.fp8 and not all(n.gpu.fp8_tflops for n in placement):
            continue
        for dims in _layouts(m, gpus, [n.gpus_per_node for n in cluster.node_types], opts):
            zeros = (0,) if dims.dp * dims.cp == 1 else (opts.zero or (1, 2, 3))
            recs = ("none", "selective", "full") if opts.recompute == "auto" else (opts.recompute,)
            sp = opts.sequence_parallel and dims.tp > 1
            for mbs, v in itertools.product(divisors(m.global_batch // dims.dp), opts.virtual_stages):
                for rec, zero in itertools.product(recs, zeros):
                    try:
                        ctx = PlanContext(cm, stage_envs(placement, dims, cm.a),
                                          PlanConfig(dims, mbs, v, rec == "full", zero, sp=sp, selective=rec == "selective",
                                                     fp8=opts.fp8, tp_overlap=opts.tp_overlap and sp))
                    except PlannerError:
                        break  # v does not fit this schedule (micro-batches vs pp, layers vs chunks)
                    got = [(ctx.partition(x), x) for x in opts.methods]
                    got = [(c, x) for c, x in got if c]
                    for counts, method in got:
                        r = ctx.result(counts, method, placement)
                        times[r.key()] = r.iteration_s
                    if got:
                        break  # fits with this rung: 'auto' recomputes no more
    return sorted(times.values())


@pytest.mark.parametrize("model,spec", [
    (SMALL, "a100-80gb:4x1,a10:4x1"),
    # interleaved schedules win here (the best plan has v = 2)
    (replace(SMALL, layers=16, global_batch=8), "a100-80gb:4x1,a10:4x1"),
    # memory binds: 13B-class layers on 24 GB A10s next to 80 GB A100s
    (TransformerShape("mid", "llama", layers=16, hidden=5120, heads=40, ffn=13824, vocab=32000, seq_len=2048,
               global_batch=16, dtype="bfloat16"), "a100-80gb:4x1,a10:4x2"),
    # long sequences without fused attention: the s x s scores bind, the A10 stages need selective
    # recomputation (the top 3 mix none and selective)
    (replace(SMALL, seq_len=16384, global_batch=8), "a100-80gb:4x1,a10:4x1"),
    (replace(SMALL, seq_len=8192, global_batch=8), "a10:4x2"),
    # long sequences with fused attention: context parallelism (cp 2 and 4) is searched; ZeRO-2/3
    # are what fit on the A10s
    (replace(LONG, layers=8), "a100-80gb:4x1,a10:4x1"),
])
def test_branch_and_bound_finds_the_brute_force_optimum(model, spec):
    cluster = parse_compact(spec)
    for v, sp in (((1,), True), ((1, 2, 4), True), ((1,), False)):  # interleaved schedules searched too
        opts = SearchOptions(all_nodes=True, top=3, virtual_stages=v, sequence_parallel=sp)
        res = search(model, cluster, opts)
        expect = brute_force(model, cluster, opts)[:3]
        assert [r.iteration_s for r in res.plans] == pytest.approx(expect)
        assert res.stats["simulated"] <= res.stats["candidates"]
        assert all(r.config.sp == (sp and r.config.dims.tp > 1) for r in res.plans)
    for rec in ("none", "selective", "full"):
        opts = SearchOptions(all_nodes=True, top=3, recompute=rec)
        res = search(model, cluster, opts)
        assert [r.iteration_s for r in res.plans] == pytest.approx(brute_force(model, cluster, opts)[:3])
        assert all(r.config.recomputation == rec for r in res.plans)
    for extra in ({"zero": (0,)}, {"zero": (3,)}, {"zero": (0, 2)}, {"tp_overlap": True}):
        opts = SearchOptions(all_nodes=True, top=3, **extra)
        res = search(model, cluster, opts)
        assert [r.iteration_s for r in res.plans] == pytest.approx(brute_force(model, cluster, opts)[:3])
        allowed = extra.get("zero") or (1, 2, 3)  # stage 0 only where one rank holds each shard
        assert all(r.config.zero in allowed if r.config.shard > 1 else r.config.zero == 0 for r in res.plans)


@pytest.mark.parametrize("model,spec", [
    (SMALL, "h100:4x1,l4:4x1"),
    (replace(LONG, layers=8), "h100:4x1,l4:4x1"),
])
def test_branch_and_bound_finds_the_brute_force_optimum_in_fp8(model, spec):
    cluster = parse_compact(spec)
    for extra in ({}, {"tp_overlap": True}):
        opts = SearchOptions(all_nodes=True, top=3, fp8=True, **extra)
        res = search(model, cluster, opts)
        assert res.plans and all(r.config.fp8 for r in res.plans)
        assert [r.iteration_s for r in res.plans] == pytest.approx(brute_force(model, cluster, opts)[:3])


def test_capped_min_max_by_hand():
    assert capped_min_max(10, [1.0, 1.0], [10, 10]) == pytest.approx(5.0)
    assert capped_min_max(10, [1.0, 1.0], [3, 10]) == pytest.approx(7.0)  # stage 0 saturates at 3
    assert capped_min_max(10, [1.0, 3.0], [10, 10]) == pytest.approx(7.5)  # 7.5 + 2.5 layers
    assert capped_min_max(10, [1.0, 1.0], [3, 3]) == float("inf")
    assert capped_min_max(2, [1.0, 5.0], [10, 10], least=1) == pytest.approx(5.0)  # every stage >= 1 layer


def test_block_orderings():
    names, k = block_orderings({"a": 2, "b": 2}, 100)
    assert k == 1 and len(names) == 6
    names, k = block_orderings({"a": 16, "b": 8}, 20000)  # 735471 orderings -> blocks of 2
    assert k == 2 and len(names) == 495 and len(set(names)) == 495
    assert all(n.count("a") == 16 and n.count("b") == 8 for n in names)
    names, k = block_orderings({"a": 5, "b": 3}, 10)
    assert k == 3 and len(set(names)) == len(names) and all(len(n) == 8 for n in names)


def test_large_cluster_is_searched_in_blocks():
    res = search(SMALL, parse_compact("a100-80gb:8x5,v100:8x5"), SearchOptions(all_nodes=True, top=1, max_orderings=50))
    assert res.stats["block_size"] == 3 and res.plans  # 252 orderings; blocks of 2 still give 180


def test_infeasible_plans_never_returned():
    m = replace(preset("llama-2-13b"), global_batch=64)
    cluster = parse_compact("a10:4x4")
    res = search(m, cluster, SearchOptions(top=50, recompute="none"))
    assert res.plans, "some plan should fit on 16 A10s"
    for r in res.plans:
        assert r.feasible
        assert all(mem <= use for mem, use in zip(r.stage_memory, r.stage_usable))
    # and the constraint binds: fewer layouts fit than exist
    assert all(r.dims.tp * r.dims.pp >= 4 for r in res.plans)


def test_nothing_fits_returns_no_plan():
    m = preset("llama-2-70b")
    res = search(m, parse_compact("l4:8x1"), SearchOptions())
    assert res.plans == []


def test_results_are_ranked_and_use_parallel_dims():
    res = search(SMALL, parse_compact("a100-80gb:8x1,v100:8x1"), SearchOptions(top=8))
    times = [r.iteration_s for r in res.plans]
    assert times == sorted(times) and len(set(r.key() for r in res.plans)) == len(res.plans)
    assert all(isinstance(r.dims, ParallelDims) for r in res.plans)


def test_cost_objective_respects_time_limit():
    cluster = parse_compact("a100-80gb:8x2,v100:8x2")
    fastest = search(SMALL, cluster, SearchOptions(top=1)).plans[0]
    limit = fastest.iteration_s * 3
    res = search(SMALL, cluster, SearchOptions(objective="cost", time_limit=limit, top=5))
    assert res.plans and all(r.iteration_s <= limit for r in res.plans)
    costs = [r.cost_per_iteration for r in res.plans]
    assert costs == sorted(costs)
    assert costs[0] <= fastest.cost_per_iteration + 1e-12


def test_throughput_objective_respects_cost_limit():
    cluster = parse_compact("a100-80gb:8x2,v100:8x2")
    res = search(SMALL, cluster, SearchOptions(objective="throughput", cost_limit=60.0, top=5))
    assert res.plans and all(r.price_per_hour <= 60.0 for r in res.plans)
    with pytest.raises(ValueError, match="cost limit"):
        SearchOptions(objective="throughput")


def test_recompute_only_when_needed():
    m = replace(preset("gpt3-175b"), vocab=51200, global_batch=64)
    # with equal layers per stage, 175B on 64 A100s fits only with recomputation (Korthikanti et al.):
    # selective with sequence parallelism, full without (selective alone keeps too much)
    opts = SearchOptions(top=3, tp=(8,), pp=(8,), mbs=(1,), methods=("balanced",))
    res = search(m, parse_compact("a100-80gb:8x8"), opts)
    assert res.plans and all(r.config.recomputation == "selective" and r.config.sp for r in res.plans)
    res = search(m, parse_compact("a100-80gb:8x8"), replace(opts, sequence_parallel=False))
    assert res.plans and all(r.config.recomputation == "full" for r in res.plans)
    assert not search(m, parse_compact("a100-80gb:8x8"), replace(opts, sequence_parallel=False, recompute="selective")).plans
    # under 1F1B the exact partitioner unloads the early stages (more micro-batches in flight) and avoids it
    res = search(m, parse_compact("a100-80gb:8x8"), SearchOptions(top=1, tp=(8,), pp=(8,), mbs=(1,), virtual_stages=(1,)))
    best = res.plans[0]
    assert best.config.recomputation == "none" and best.partition[0] < best.partition[-1]
    res = search(SMALL, parse_compact("a100-80gb:8x1"), SearchOptions(top=3))
    assert all(r.config.recomputation == "none" for r in res.plans)


def test_interleaved_candidates_are_searched():
    m = replace(SMALL, layers=16, global_batch=64)
    res = search(m, parse_compact("a100-80gb:8x1,v100:8x1"), SearchOptions(top=50, virtual_stages=(1, 2), pp=(2, 4)))
    assert any(r.config.v == 2 for r in res.plans)


def test_search_speed_target():
    """GPT-2 1.5B on 32 GPUs of two types, the whole space (sub-clusters included): <= 5 s."""
    t0 = time.perf_counter()
    res = search(preset("gpt2-1.5b"), parse_compact("a100-80gb:8x2,v100:8x2"))
    elapsed = time.perf_counter() - t0
    assert res.plans
    assert elapsed <= 5.0, f"search took {elapsed:.2f} s"


def test_family_fill_bound_holds_for_every_stage_order():
    """The bound a family of gatherings gets per node set that comes last (the order of the others
    unknown) never exceeds the bound of any ordering of its stages that ends on that set, for every
    micro-batch size, 1F1B and interleaved, and every recomputation rung."""
    from computron.planner.search import _StageTables, _family_fill_bound, _fill_bound, _recompute_choice

    m = replace(SMALL, layers=48, hidden=2048, ffn=8192, seq_len=4096, global_batch=64)  # all three rungs bind
    cluster = parse_compact("a100-80gb:4x1,a100-40gb:4x1,a10:4x2")
    nts = {n.name: n for n in cluster.node_types}
    dims = ParallelDims(dp=1, tp=4, pp=4)
    opts = SearchOptions()
    tabs = _StageTables(m, dims, opts, CostModel(m))
    ids = [tabs.set_id((n,), (nts[n],)) for n in ("a100-80gb", "a100-40gb", "a10")]
    checked = {1: 0, 2: 0, "none": 0, "selective": 0, "full": 0}
    for family in ([ids[0], ids[1], ids[2], ids[2]], [ids[2]] * 3 + [ids[0]], [ids[1], ids[1], ids[2], ids[2]]):
        for b in divisors(m.global_batch):
            for v in (1, 2):
                fam = _family_fill_bound(m, tuple(family), b, v, opts, tabs, math.inf)
                for sig in set(itertools.permutations(family)):
                    rec = _recompute_choice(m, sig, b, v, opts, tabs)
                    if rec is None:
                        continue
                    least = _fill_bound(m, sig, b, v, rec, tabs, rel_tol=1e-9)  # the least T, to 1e-9
                    assert fam[sig[-1]] <= least * (1 + 1e-9)
                    checked[v] += 1
                    checked[rec[1]] += 1
    assert checked[1] > 100 and checked[2] > 50 and min(checked[x] for x in ("none", "selective", "full")) > 10


def test_sequence_parallelism_is_searched_and_fits_what_replicated_norms_do_not():
    """13B-class layers at 16k tokens on 8 A10s without recomputation: nothing fits with the norms'
    and dropouts' activations replicated over the tensor ranks; with sequence parallelism (the
    search's default for tp > 1) a tp=4 plan does, and its estimate says sp."""
    m = TransformerShape("mid", "llama", layers=16, hidden=5120, heads=40, ffn=13824, vocab=32000, seq_len=16384,
                         global_batch=16, dtype="bfloat16")
    cluster = parse_compact("a10:4x2")
    assert not search(m, cluster, SearchOptions(top=1, recompute="none", sequence_parallel=False, cp=(1,))).plans
    best = search(m, cluster, SearchOptions(top=1, recompute="none", cp=(1,))).plans
    assert best and best[0].config.dims.tp > 1 and best[0].config.sp and best[0].feasible


def test_selective_recomputation_finds_a_plan_none_then_full_misses():
    """GPT-class layers at 16k tokens without fused attention on A100-40GB + A10 nodes: the scores do
    not fit without recomputation; the best plan recomputes only the attention core and beats every
    plan that recomputes nothing or everything (the old ladder's best is one of those)."""
    m = replace(SMALL, seq_len=16384, global_batch=8)
    cluster = parse_compact("a100-40gb:4x1,a10:4x1")
    best = search(m, cluster, SearchOptions(top=1)).plans[0]
    assert best.config.recomputation == "selective" and best.feasible
    assert best.breakdown["recompute"] > 0
    assert not search(m, cluster, SearchOptions(top=1, recompute="none")).plans
    full = search(m, cluster, SearchOptions(top=1, recompute="full")).plans[0]
    assert best.iteration_s < full.iteration_s


def test_zero_stages_are_rungs_before_recomputation():
    """32 layers of 4096 on 8 A10s, no pipeline: memory binds, and the search takes for each
    configuration the first ZeRO stage that fits (never 0, which 1 beats) before recomputing,
    agreeing with the brute force, with the stages asked for too; the best plan is a ZeRO-2 one
    whose gradient reduce-scatter runs under the backward."""
    m = TransformerShape("z", "llama", layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000, seq_len=1024,
                         global_batch=16, kv_heads=8, dtype="bfloat16")
    cluster = parse_compact("a10:4x2")
    for extra in ({}, {"zero": (0, 1)}, {"zero": (3,)}):
        opts = SearchOptions(all_nodes=True, top=3, pp=(1,), **extra)
        res = search(m, cluster, opts)
        assert [r.iteration_s for r in res.plans] == pytest.approx(brute_force(m, cluster, opts)[:3])
    best = search(m, cluster, SearchOptions(top=3, pp=(1,))).plans
    assert best[0].config.zero == 2 and best[0].config.recomputation == "none"
    assert all(r.config.zero >= 1 for r in best if r.config.shard > 1)
    only1 = search(m, cluster, SearchOptions(top=1, pp=(1,), zero=(1,))).plans[0]
    assert only1.iteration_s > best[0].iteration_s


def test_context_parallel_degrees_rule():
    from computron.planner.search import cp_degrees

    assert cp_degrees(preset("gpt3-13b"), SearchOptions()) == (1,)  # no fused attention
    assert cp_degrees(preset("llama-2-7b"), SearchOptions()) == (1,)  # 4K tokens: cp would keep 2K
    assert cp_degrees(preset("llama-3-8b"), SearchOptions()) == (1, 2)  # 8K
    assert cp_degrees(replace(preset("llama-3-8b"), seq_len=131072), SearchOptions()) == (1, 2, 4, 8, 16, 32)
    assert cp_degrees(preset("llama-3-8b"), SearchOptions(cp=(4,))) == (4,)
    res = search(replace(LONG, layers=8), parse_compact("a100-80gb:4x1,a10:4x1"), SearchOptions(all_nodes=True, top=1))
    assert res.plans[0].config.dims.cp > 1  # 16K tokens: splitting the sequence wins here


def test_fp8_needs_fp8_gpus_everywhere():
    m = replace(SMALL, flash_attention=True)
    assert search(m, parse_compact("h100:8x1"), SearchOptions(top=1, fp8=True, all_nodes=True)).plans
    mixed = search(m, parse_compact("h100:8x1,a100-80gb:8x1"), SearchOptions(top=5, fp8=True))
    assert mixed.plans and all(set(r.placement) == {"h100"} for r in mixed.plans)


def test_progress_is_reported_with_a_bound_below_the_best():
    seen = []
    res = search(preset("gpt2-1.5b"), parse_compact("a100-80gb:8x2,v100:8x2"), SearchOptions(top=1),
                 progress=lambda bound, best, stats: seen.append((bound, best)))
    assert seen and all(b <= res.plans[0].iteration_s * (1 + 1e-9) or best == math.inf for b, best in seen)
