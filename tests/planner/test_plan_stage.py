"""One stage's time, as the planner assembles it from compute and TP communication, against a hand computation."""

import pytest

from computron.parallel.dims import ParallelDims
from computron.planner.costs import Assumptions
from computron.planner.estimate import CostModel, PlanConfig, PlanContext
from computron.planner.hardware import parse_compact
from computron.planner.layout import stage_envs
from computron.planner.model import TransformerShape

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

    def kernel(flops, nbytes):
        return max(flops / peak, nbytes / hbm) + ko

    def gemm(K, N):
        return kernel(2 * tok * K * N, e * (tok * K + K * N + tok * N))

    hr = b * heads // t  # attention heads per rank
    attn = hr * 2 * s * s * d, hr * e * (2 * s * d + s * s)  # scores, and again context
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
