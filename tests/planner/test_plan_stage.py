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
