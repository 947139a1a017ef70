"""One stage's time, as the planner assembles it from compute and TP communication, against a hand computation."""

from dataclasses import replace

import pytest

from computron.parallel.dims import ParallelDims
from computron.planner import costs
from computron.planner.costs import Assumptions
from computron.planner.estimate import CostModel, PlanConfig, PlanContext
from computron.planner.hardware import parse_compact
from computron.planner.layout import stage_envs
from computron.planner.model import TransformerShape, preset

# GPT family: no fused attention, dropout on; 4 layers of h=1024, 16 heads, f=4096, s=512.
M = TransformerShape("g", "gpt", layers=4, hidden=1024, heads=16, ffn=4096, vocab=50000, seq_len=512, global_batch=4)


def test_stage_time_is_compute_plus_tp_allreduces_by_hand():
    node = parse_compact("a100-80gb:2x1").node_types[0]
    a = Assumptions()
    cfg = PlanConfig(ParallelDims(dp=1, tp=2, pp=1), mbs=1)
    ctx = PlanContext(CostModel(M, a), stage_envs((node,), cfg.dims, a), cfg)
    r = ctx.result((4,), "given", (node,))

    t, b, e, s, h, heads, f, L = 2, 1, 2, 512, 1024, 16, 4096, 4
    d, tok = h // heads, b * s
    peak, hbm = node.gpu.tflops * 1e12 * node.gpu.gemm_eff, node.gpu.hbm_bw * a.hbm_eff
    ko = a.kernel_overhead_s

    def kernel(flops, nbytes, n):  # n: the product's smallest dimension sets its efficiency
        return max(flops / (peak * n / (n + a.gemm_half_dim)), nbytes / hbm) + ko

    def gemm(K, N):
        return kernel(2 * tok * K * N, e * (tok * K + K * N + tok * N), min(tok, K, N))

    hr = b * heads // t  # attention heads per rank
    attn = hr * 2 * s * s * d, hr * e * (2 * s * d + s * s), d  # scores, and again context (smallest: d)
    gemms = gemm(h, 3 * h // t) + gemm(h // t, h) + gemm(h, f // t) + gemm(f // t, h) + 2 * kernel(*attn)
    elem = (15 * e * tok * h + 2 * e * tok * f / t + 4.5 * e * hr * s * s) / hbm + 8 * ko
    fwd, bwd = gemms + elem, 2 * gemms + 2 * elem

    allreduce = 2 * (t - 1) / t * (e * tok * h) / (node.intra_bw * a.intra_eff) + 2 * (t - 1) * a.intra_latency_s
    layer_tp = 2 * allreduce + 2 * allreduce  # forward: after attention and MLP; backward: before QKV and MLP-up
    assert r.stage_time == [pytest.approx(L * (fwd + bwd + layer_tp), rel=1e-12)]

    ce = 3 * (2 * (t - 1) / t * (4 * tok) / (node.intra_bw * a.intra_eff) + 2 * (t - 1) * a.intra_latency_s)
    assert r.breakdown["tp"] == pytest.approx(r.micro_batches * (L * layer_tp + allreduce + ce), rel=1e-12)


def test_max_layers_is_the_last_count_that_fits():
    """The linear start and the steps land on the largest n <= L whose stage memory fits, for
    random terms, interleaving (ceil(n/v)), ZeRO-1 and budgets from nothing to everything."""
    import random

    from computron.planner.estimate import MemoryTerms, max_layers, stage_memory

    rng = random.Random(3)
    a = Assumptions()
    for _ in range(400):
        t = MemoryTerms(rng.uniform(1e6, 1e9), rng.uniform(0, 1e9), rng.uniform(0, 5e8), rng.uniform(0, 1e9),
                        rng.uniform(0, 1e8), rng.uniform(0, 2e9))
        L, v, mb, dp = rng.randint(1, 100), rng.choice([1, 2, 3]), rng.randint(1, 64), rng.choice([1, 2, 8])
        inflight, zero1 = rng.randint(1, 40), rng.random() < 0.5
        usable = rng.uniform(0, 2) * stage_memory(t, L, inflight, mb, v, dp, zero1, a)
        fit = [n for n in range(L + 1) if stage_memory(t, n, inflight, mb, v, dp, zero1, a) <= usable]
        assert max_layers(t, usable, L, inflight, mb, v, dp, zero1, a) == (max(fit) if fit else 0)


def _ctx(dims, a, mbs=1, v=1, **kw):
    from dataclasses import replace as _r

    m = _r(M, layers=8, global_batch=32)
    nodes = dims.tp * dims.pp * dims.dp // 8
    node = parse_compact(f"a100-80gb:8x{nodes}").node_types[0]
    cfg = PlanConfig(dims, mbs, v, **kw)
    return PlanContext(CostModel(m, a), stage_envs((node,) * nodes, dims, a), cfg), (node,) * nodes


def test_chunk_overhead_on_every_chunk_op_with_pipelines_only():
    dims = ParallelDims(dp=4, tp=1, pp=2)
    base, _ = _ctx(dims, Assumptions(chunk_overhead_s=0.0), v=2)
    more, _ = _ctx(dims, Assumptions(chunk_overhead_s=1e-3), v=2)
    (f0, b0), (f1, b1) = base.durations((4, 4)), more.durations((4, 4))
    assert len(f1) == 4 and all(y - x == pytest.approx(1e-3) for x, y in zip(f0 + b0, f1 + b1))
    t0, c0 = base.linear_terms()
    t1, c1 = more.linear_terms()
    assert t1 == t0 and all(y - x == pytest.approx(2 * 2 * 1e-3) for x, y in zip(c0, c1))  # 2 ops x v chunks
    flat0, _ = _ctx(ParallelDims(dp=8, tp=1, pp=1), Assumptions(chunk_overhead_s=0.0))
    flat1, _ = _ctx(ParallelDims(dp=8, tp=1, pp=1), Assumptions(chunk_overhead_s=1e-3))
    assert flat0.durations((8,)) == flat1.durations((8,))


def test_straggler_wait_is_the_pipeline_time_times_the_factor():
    from computron.planner import costs, schedule

    dims = ParallelDims(dp=8, tp=1, pp=1)
    ctx0, pl = _ctx(dims, Assumptions(dp_jitter=0.0))
    ctx1, _ = _ctx(dims, Assumptions(dp_jitter=0.05))
    r0, r1 = ctx0.result((8,), "given", pl), ctx1.result((8,), "given", pl)
    fwd, bwd = ctx0.durations((8,))
    finish = schedule.simulate(1, 1, ctx0.mb, fwd, bwd).finish[0]
    wait = finish * costs.straggler_factor(8, Assumptions(dp_jitter=0.05))
    assert r1.iteration_s - r0.iteration_s == pytest.approx(wait)
    assert r1.breakdown["dp"] - r0.breakdown["dp"] == pytest.approx(wait)
    assert ctx1.lower_bound((8,)) <= r1.iteration_s + 1e-12
    one0, pl1 = _ctx(ParallelDims(dp=1, tp=8, pp=1), Assumptions(dp_jitter=0.0))
    one1, _ = _ctx(ParallelDims(dp=1, tp=8, pp=1), Assumptions(dp_jitter=0.05))
    assert one0.result((8,), "given", pl1).iteration_s == one1.result((8,), "given", pl1).iteration_s


def test_dp_overlap_hides_the_allreduce_behind_the_last_backward():
    dims = ParallelDims(dp=8, tp=1, pp=1)
    a = Assumptions()
    serial, _ = _ctx(dims, a)
    over, _ = _ctx(dims, a, dp_overlap=True)
    ar = serial.tails((8,))[0][0]
    window = 8 * serial.stages[0].lb
    assert over.tails((8,))[0][0] == pytest.approx(max(ar - window, 0.0))
    assert over.tails((8,))[0][0] < ar


def test_published_sequence_parallel_selective_run_fits_and_is_faster():
    """Korthikanti et al. 2022: GPT 175B, tp=8, pp=8, mbs=1 ran with sequence parallelism and
    selective recomputation (13.75 s) and with full recomputation (18.13 s)."""
    m = TransformerShape("175b", "gpt", 96, 12288, 96, 4 * 12288, 51200, 2048, 64)
    dims = ParallelDims(dp=1, tp=8, pp=8)
    node = parse_compact("a100-80gb:8x8").node_types[0]
    out = {}
    for name, kw in {"none": {}, "full": {"recompute": True}, "sel": {"sp": True, "selective": True}}.items():
        cm = CostModel(m)
        ctx = PlanContext(cm, stage_envs((node,) * 8, dims, cm.a), PlanConfig(dims, 1, **kw))
        out[name] = ctx.result(ctx.partition("balanced", respect_memory=False), "balanced", (node,) * 8)
    assert not out["none"].feasible and out["full"].feasible and out["sel"].feasible
    assert out["sel"].iteration_s < out["full"].iteration_s
    assert out["sel"].iteration_s == pytest.approx(13.75, rel=0.10)
    assert out["sel"].breakdown["recompute"] < 0.2 * out["full"].breakdown["recompute"]


def _one(m, spec, dims, a=None, **kw):
    cm = CostModel(m, a or Assumptions())
    cl = parse_compact(spec)
    node = cl.node_types[0]
    placement = (node,) * (dims.world_size // node.gpus_per_node)
    ctx = PlanContext(cm, stage_envs(placement, dims, cm.a), PlanConfig(dims, 1, **kw))
    return ctx.result(ctx.partition("balanced", respect_memory=False), "balanced", placement)


def test_zero_stages_trade_memory_for_traffic():
    m = replace(preset("llama-2-7b"), global_batch=64)
    dims = ParallelDims(dp=16, tp=1, pp=1)
    r = [_one(m, "a100-80gb:8x2", dims, zero=z) for z in range(4)]
    mem = [max(x.stage_memory) for x in r]
    assert mem[0] > mem[1] > mem[2] > mem[3]
    assert not r[0].feasible and r[3].feasible  # 7B at 16 bytes a parameter does not fit an 80 GB GPU
    assert r[1].breakdown["other"] < r[0].breakdown["other"]  # a 16th of the optimizer step
    # stage 2 reduce-scatters the gradients under the backward: half of stage 1's tail is left
    assert r[2].breakdown["dp"] < r[1].breakdown["dp"]
    # stage 3: nothing after the step; each micro-batch's forward and backward wait for their first
    # layer's gather (prefetching hides the others behind compute here)
    env = stage_envs((parse_compact("a100-80gb:8x2").node_types[0],) * 2, dims, Assumptions())[0]
    ag, _ = costs.zero_layer_comm(m.layer_params(1), 16, env.dp_bw, env.dp_latency, 3)
    mb = 64 // 16
    assert r[3].breakdown["dp"] >= 2 * mb * ag > 0
    assert PlanConfig(dims, 1, 1, False, True).zero == 1  # the former zero1 flag, positionally
    with pytest.raises(ValueError, match="ZeRO stage"):
        PlanConfig(dims, 1, zero=4)


def test_context_parallelism_divides_activations_and_adds_ring_traffic():
    m = replace(preset("llama-3-8b"), seq_len=32768, global_batch=8)
    one = _one(m, "h100:8x1", ParallelDims(dp=1, tp=8, pp=1), sp=True, recompute=True)
    four = _one(m, "h100:8x4", ParallelDims(dp=1, tp=8, pp=1, cp=4), sp=True, recompute=True)
    assert max(four.stage_memory) < max(one.stage_memory)
    assert four.iteration_s < one.iteration_s / 2  # a quarter of the work per rank, less the ring's
    assert four.breakdown["cp"] >= 0.0 and four.config.dims.world_size == 32


def test_fp8_and_tp_overlap_are_faster_where_they_apply():
    m = replace(preset("llama-2-13b"), global_batch=16)
    dims = ParallelDims(dp=1, tp=8, pp=1)
    base = _one(m, "h100:8x1", dims, sp=True, recompute=True)
    fp8 = _one(m, "h100:8x1", dims, sp=True, recompute=True, fp8=True)
    ovl = _one(m, "h100:8x1", dims, sp=True, recompute=True, tp_overlap=True)
    assert fp8.iteration_s < base.iteration_s and fp8.breakdown["compute"] < base.breakdown["compute"]
    # fp8 weights and their transposes replace the 16-bit weights (fp8_param_gather) ...
    assert max(fp8.stage_memory) <= max(base.stage_memory)
    # ... or come on top of them (Megatron-LM's default): 2 more bytes a layer parameter
    cached = _one(m, "h100:8x1", dims, Assumptions(fp8_params=False), sp=True, recompute=True, fp8=True)
    assert max(cached.stage_memory) - max(fp8.stage_memory) == pytest.approx(2 * m.layers * m.layer_params(8))
    assert ovl.breakdown["tp"] < base.breakdown["tp"] and ovl.iteration_s < base.iteration_s
    with pytest.raises(ValueError, match="no fp8"):
        _one(m, "a100-80gb:8x1", dims, sp=True, fp8=True)
    with pytest.raises(ValueError, match="needs sequence parallelism"):
        PlanConfig(dims, 1, tp_overlap=True)


def test_zero3_copies_enter_each_layer_op_by_hand():
    """The published FSDP run's layout (Llama 3 70B, FSDP over 64 ranks, cp 2, full recomputation):
    each layer's forward op gains the copy-out, its backward the copy-out and the gradients' copy-in,
    serial on the compute stream and reported under dp; ZeRO-1 and ZeRO-2 gain nothing."""
    m = replace(preset("llama-3-70b"), global_batch=128)
    dims = ParallelDims(dp=32, tp=1, pp=1, cp=2)
    P, bw = m.layer_params(1), 3350e9 * 0.8
    runs = {}
    for name, a in (("copies", Assumptions(bytes_per_param=18)),
                    ("flat", Assumptions(bytes_per_param=18, zero3_copies=False))):
        cm = CostModel(m, a)
        node = parse_compact("h100:8x8").node_types[0]
        ctx = PlanContext(cm, stage_envs((node,) * 8, dims, a), PlanConfig(dims, 1, recompute=True, zero=3))
        runs[name] = (ctx.stages[0], ctx.result((80,), "given", (node,) * 8))
    (st, r), (st0, r0) = runs["copies"], runs["flat"]
    assert st.lf - st0.lf == pytest.approx(4 * P / bw)
    assert st.lb - st0.lb == pytest.approx((4 + 2 + 4) * P / bw)
    assert st.l_zero - st0.l_zero == pytest.approx(14 * P / bw)
    # 4 micro-batches x (80 layers + the embedding and head) x 14 bytes a parameter, and the
    # replicas' wait on top; the embedding's and head's copies count as their compute
    extra, fixed = 4 * 80 * 14 * P / bw, 4 * 14 * (m.embedding_params(1) + m.head_params(1, 1)) / bw
    z = costs.straggler_factor(32)
    assert r.iteration_s - r0.iteration_s == pytest.approx((extra + fixed) * (1 + z))
    assert r.breakdown["dp"] - r0.breakdown["dp"] == pytest.approx(extra * (1 + z) + fixed * z)
    for zero in (1, 2):
        a = Assumptions()
        cm = CostModel(m, a)
        node = parse_compact("h100:8x8").node_types[0]
        with_c = PlanContext(cm, stage_envs((node,) * 8, dims, a), PlanConfig(dims, 1, recompute=True, zero=zero))
        b = Assumptions(zero3_copies=False)
        without = PlanContext(CostModel(m, b), stage_envs((node,) * 8, dims, b), PlanConfig(dims, 1, recompute=True,
                                                                                              zero=zero))
        assert with_c.stages[0].lf == without.stages[0].lf and with_c.stages[0].lb == without.stages[0].lb


def test_fp8_first_stage_memory_of_the_published_run_by_hand():
    """Megatron-Bridge's fp8 Llama 3 70B run (tp 4, pp 8, v 5, dp 2, ZeRO-1, sequence parallelism,
    256 sequences): its first stage, counted by hand, is 65.0 GiB, within the 71.0 GiB usable."""
    m = replace(preset("llama-3-70b"), global_batch=256)
    dims = ParallelDims(dp=2, tp=4, pp=8)
    a = Assumptions()
    node = parse_compact("h100:8x8").node_types[0]
    ctx = PlanContext(CostModel(m, a), stage_envs((node,) * 8, dims, a),
                      PlanConfig(dims, 1, v=5, zero=1, sp=True, fp8=True))
    layer, emb = m.layer_params(4), m.embedding_params(4)
    # fp8 weight + transpose (2), bf16 gradient (2), fp32 master, m, v over dp 2 (6); the embedding
    # keeps its 16-bit weight (2 + 2 + 6)
    states = 10 * layer * 10 + emb * 10
    # 47 (chunk, micro-batch) pairs in flight, 2 layers each, 59,392 bytes a token a layer (plus the
    # fused attention's log-sum-exp); 16 first-chunk micro-batches keep their 8-byte token ids
    acts = 47 * 2 * (8192 * 59392 + 4 * 16 * 8192) + 16 * 8 * 8192
    assert ctx.memory(0, 10) == pytest.approx(states + acts)
    assert ctx.memory(0, 10) / 2**30 == pytest.approx(65.0, abs=0.05)
    assert ctx.stages[0].usable / 2**30 == pytest.approx(71.0)


def test_tp_collective_cost_is_paid_by_every_tp_all_reduce_of_the_step():
    """Each TP all-reduce a step issues (4 a layer, the embedding's and 3 for the loss, per
    micro-batch) pays ``tp_collective_s`` on top of its ring time; tp=1 issues none."""
    node = parse_compact("a100-80gb:2x1").node_types[0]

    def run(tp, c):
        a = Assumptions(tp_collective_s=c)
        cfg = PlanConfig(ParallelDims(dp=2 // tp, tp=tp, pp=1), mbs=1)
        ctx = PlanContext(CostModel(M, a), stage_envs((node,), cfg.dims, a), cfg)
        return ctx.result((4,), "given", (node,))

    base, more = run(2, 0.0), run(2, 1e-4)
    per_step = base.micro_batches * (4 * M.layers + 1 + 3)
    assert more.iteration_s - base.iteration_s == pytest.approx(per_step * 1e-4, rel=1e-9)
    assert more.breakdown["tp"] - base.breakdown["tp"] == pytest.approx(per_step * 1e-4, rel=1e-9)
    assert run(1, 1e-4).iteration_s == run(1, 0.0).iteration_s


def test_a_measured_tp_collective_cost_replaces_the_constant_at_its_tp_only():
    """``tp_collective_by_tp`` (a run's measurement per tp size) is what a layout of that tp pays per
    all-reduce; a tp size it does not hold pays ``tp_collective_s``."""
    def run(tp, a):
        node = parse_compact(f"a100-80gb:{tp}x1").node_types[0]
        cfg = PlanConfig(ParallelDims(dp=1, tp=tp, pp=1), mbs=1)
        ctx = PlanContext(CostModel(M, a), stage_envs((node,), cfg.dims, a), cfg)
        return ctx.result((4,), "given", (node,))

    fitted = Assumptions(tp_collective_s=1e-4)
    measured = Assumptions(tp_collective_s=1e-4, tp_collective_by_tp=((2, 3e-4),))
    assert (measured.tp_collective_at(2), measured.tp_collective_at(4)) == (3e-4, 1e-4)
    base, more = run(2, fitted), run(2, measured)
    per_step = base.micro_batches * (4 * M.layers + 1 + 3)
    assert more.iteration_s - base.iteration_s == pytest.approx(per_step * 2e-4, rel=1e-9)
    assert run(4, measured).iteration_s == run(4, fitted).iteration_s


def test_pipeline_chunk_overhead_by_hand():
    """pp=2 1F1B over m micro-batches: every path through the schedule runs 2(m + p - 1) chunk ops
    (m forwards and backwards on one stage, p - 1 of each on the others), so an overhead of c on
    every op makes the iteration exactly 2(m + p - 1) c longer; with pp=1 it costs nothing."""
    node = parse_compact("a100-80gb:2x1").node_types[0]
    m8 = replace(M, global_batch=8)

    def run(ov, pp=2):
        a = Assumptions(chunk_overhead_s=ov)
        cfg = PlanConfig(ParallelDims(dp=2 // pp, tp=1, pp=pp), mbs=1)
        ctx = PlanContext(CostModel(m8, a), stage_envs((node,), cfg.dims, a), cfg)
        return ctx.result((2, 2) if pp == 2 else (4,), "given", (node,))

    r0, r1 = run(0.0), run(1e-3)
    assert r0.micro_batches == 8
    assert r1.iteration_s - r0.iteration_s == pytest.approx(2 * (8 + 2 - 1) * 1e-3, rel=1e-9)
    assert run(1e-3, pp=1).iteration_s == run(0.0, pp=1).iteration_s
