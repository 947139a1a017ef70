"""Each cost formula against a hand computation."""

import math
from dataclasses import replace

import pytest

from computron.planner import costs
from computron.planner.costs import Assumptions
from computron.planner.hardware import GPU_TYPES
from computron.planner.model import TransformerShape, preset

A100 = GPU_TYPES["a100-80gb"]
GPT = TransformerShape("g", "gpt", layers=4, hidden=1024, heads=16, ffn=4096, vocab=50000, seq_len=512, global_batch=32)


def test_roofline_compute_and_memory_bound():
    a = Assumptions(kernel_overhead_s=0.0)
    # 1e12 FLOPs on 312 TFLOP/s at the A100's 0.87 asymptote, few bytes: compute-bound
    assert A100.gemm_eff == 0.87
    assert costs.roofline(1e12, 1e3, A100, "float16", a) == pytest.approx(1e12 / (312e12 * 0.87))
    assert costs.roofline(1e12, 1e3, A100, "float16", a, eff=0.5) == pytest.approx(1e12 / (312e12 * 0.5))
    # 1 GB moved, few FLOPs: memory-bound at 2039 GB/s * 0.8
    assert costs.roofline(1.0, 1e9, A100, "float16", a) == pytest.approx(1e9 / (2039e9 * 0.8))
    assert costs.roofline(0, 0, A100, "float16", Assumptions(kernel_overhead_s=5e-6)) == pytest.approx(5e-6)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_layer_gemm_flops_are_megatrons(t):
    b, s, h = 2, GPT.seq_len, GPT.hidden
    total = sum(fl for _, fl, _ in costs.layer_gemms(GPT, t, b))
    assert total == pytest.approx((24 * b * s * h * h + 4 * b * s * s * h) / t)


def test_gemm_bytes_by_hand():
    qkv = costs.layer_gemms(GPT, 1, 1)[0]
    M, K, N = 512, 1024, 3 * 1024
    assert qkv == ("qkv", 2.0 * M * K * N, 2 * (M * K + K * N + M * N))


def test_flash_attention_flops_half_of_full_causal():
    m = replace(GPT, flash_attention=True)
    fl, by = costs.flash_attention_fwd(m, 2, 1)
    assert fl == pytest.approx(4 * 1 * 8 * 512 * 512 * 64 * 0.5)
    assert by == pytest.approx(8 * 2 * 4 * 512 * 64)
    assert all(name not in ("scores", "context") for name, _, _ in costs.layer_gemms(m, 2, 1))


def test_backward_is_twice_forward_without_fusion():
    f, b = costs.layer_compute(GPT, A100, 1, 1)
    assert b == pytest.approx(2 * f)


def test_elementwise_bytes_by_hand():
    M, h, e = 512, 1024, 2
    expect = 15 * e * M * h + 2 * e * M * 4096 + 4.5 * e * 16 * 512 * 512
    assert costs.elementwise_bytes(GPT, 1, 1) == pytest.approx(expect)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_activation_memory_is_korthikanti(t):
    b, s, h, a = 3, GPT.seq_len, GPT.hidden, GPT.heads
    assert costs.activation_bytes(GPT, t, b) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))


def test_activation_memory_llama_gqa_flash():
    m = preset("llama-2-70b")  # gated, no dropout, flash, 8 kv heads
    t, b, s, h = 8, 1, m.seq_len, m.hidden
    M = b * s
    expect = 2 * M * 4 * h + 2 * M * (2 * h / t + 2 * 1 * 128) + 2 * M * m.ffn / t * 3 + 4 * b * 64 / t * s
    assert costs.activation_bytes(m, t, b) == pytest.approx(expect)
    assert costs.layer_input_bytes(m, 2) == 2 * 2 * s * h


@pytest.mark.parametrize("t", [1, 2, 4])
def test_relu_mlp_keeps_one_ffn_tensor(t):
    """ReLU's backward reads its output, which the down projection keeps anyway: one e*M*f/t fewer
    bytes than GeLU's; the GeLU and gated shapes keep Megatron's counts."""
    b, M = 2, 2 * GPT.seq_len
    relu = replace(GPT, activation="relu")
    assert GPT.activation == "gelu_new" and costs.mlp_kept(GPT) == 2 and costs.mlp_kept(preset("llama-2-7b")) == 3
    assert costs.activation_bytes(GPT, t, b) - costs.activation_bytes(relu, t, b) == pytest.approx(2 * M * GPT.ffn / t)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_unfused_llama_by_hand(t):
    """Llama-2-7B (one K/V head per query head) as the trainer keeps it: norms' inputs and outputs
    and their float32 1/rms, replicated; the QKV output (3h), the rotated Q and K (2h), the attention
    output (h), the up projection's output (2f), the SiLU output and the product, sharded; the
    log-sum-exp. Off (the default), Megatron's count; GPT's layer is the same either way."""
    m, on = preset("llama-2-7b"), Assumptions(unfused_llama=True)
    s, h, f, a, b = m.seq_len, m.hidden, m.ffn, m.heads, 2
    M = b * s
    expect = 2 * M * 4 * h + 4 * 2 * M + 2 * M * (6 * h + 4 * f) / t + 4 * b * a / t * s
    assert costs.activation_bytes(m, t, b, a=on) == pytest.approx(expect)
    megatron = 2 * M * 4 * h + 2 * M * (4 * h + 3 * f) / t + 4 * b * a / t * s
    assert costs.activation_bytes(m, t, b) == costs.activation_bytes(m, t, b, a=Assumptions()) == pytest.approx(megatron)
    assert costs.mlp_kept(m) == 3 and costs.mlp_kept(m, on) == 4
    assert costs.activation_bytes(GPT, t, b, a=on) == costs.activation_bytes(GPT, t, b)


def test_trainer_assumptions_count_its_llama_layer():
    from computron.train.accuracy import assumptions

    assert assumptions().unfused_llama and not Assumptions().unfused_llama


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="unknown activation"):
        replace(GPT, activation="swish")


def test_ring_allreduce_by_hand():
    assert costs.ring_allreduce(1e9, 1, 1e9, 1e-5) == 0.0
    assert costs.ring_allreduce(1e9, 4, 1e11, 1e-5) == pytest.approx(2 * 3 / 4 * 1e9 / 1e11 + 6 * 1e-5)


def test_tp_allreduce_and_layer_comm():
    a = Assumptions()
    nbytes = 2 * 2 * 512 * 1024
    one = 2 * 7 / 8 * nbytes / (300e9 * 0.8) + 14 * a.intra_latency_s
    assert costs.tp_allreduce(GPT, 8, 2, 300e9, a) == pytest.approx(one)
    assert costs.layer_tp_comm(GPT, 8, 2, 300e9, a) == pytest.approx((2 * one, 2 * one))
    assert costs.layer_tp_comm(GPT, 1, 2, 300e9, a) == (0.0, 0.0)


def test_p2p_scatter_gather():
    a = Assumptions()
    E = 2 * 1 * 512 * 1024
    assert costs.p2p_time(GPT, 1, 1, 25e9, 300e9, a) == pytest.approx(E / 25e9 + a.p2p_latency_s)
    sg = E / 4 / 25e9 + a.p2p_latency_s + 3 / 4 * E / (300e9 * 0.8) + 3 * a.intra_latency_s
    assert costs.p2p_time(GPT, 4, 1, 25e9, 300e9, a) == pytest.approx(sg)
    assert costs.p2p_time(GPT, 4, 1, 25e9, 300e9, replace(a, scatter_gather=False)) == pytest.approx(E / 25e9 + a.p2p_latency_s)


def test_torch_zero1_all_reduces_the_gradient_then_broadcasts_the_fp32_masters():
    """ZeRO-1 as torch's ZeroRedundancyOptimizer over fp32 masters: DDP's all-reduce of the 4-byte
    gradients, then (n-1)/n of the 4-byte masters received; Megatron's reduce-scatter + 2-byte gather."""
    p, n, bw = 1e9, 4, 1e10
    torch_zero = Assumptions(bytes_per_param=18, zero_shards_master=False)
    assert costs.dp_allreduce(p, n, bw, 0.0, torch_zero, 1) == pytest.approx((2 * 3 / 4 * 4e9 + 3 / 4 * 4e9) / bw)
    assert costs.dp_allreduce(p, n, bw, 0.0, torch_zero, 0) == pytest.approx(2 * 3 / 4 * 4e9 / bw)
    megatron = Assumptions(bytes_per_param=18)
    assert costs.dp_allreduce(p, n, bw, 0.0, megatron, 1) == pytest.approx(3 / 4 * (4e9 + 2e9) / bw)


def test_dp_allreduce_grad_bytes():
    p = 1e9
    assert costs.dp_allreduce(p, 8, 1e10, 0.0, Assumptions()) == pytest.approx(2 * 7 / 8 * 2e9 / 1e10)
    assert costs.dp_allreduce(p, 8, 1e10, 0.0, Assumptions(bytes_per_param=18)) == pytest.approx(2 * 7 / 8 * 4e9 / 1e10)


def test_embedding_sync_two_ranks():
    got = costs.embedding_sync(GPT, 2, 1e10, 1e-5, Assumptions())
    assert got == pytest.approx(50000 * 1024 / 2 * 2 / 1e10 + 2 * 1e-5)


def test_optimizer_step_memory_bound():
    a = Assumptions(kernel_overhead_s=0.0)
    assert costs.optimizer_step(1e9, A100, 4, False, a) == pytest.approx(1e9 * 40 / (2039e9 * 0.8))
    assert costs.optimizer_step(1e9, A100, 4, True, a) == pytest.approx(1e9 / 4 * 40 / (2039e9 * 0.8))


def test_state_bytes_16_18_20_and_zero1():
    assert costs.state_bytes(1e9, 8, False, Assumptions()) == pytest.approx(16e9)
    assert costs.state_bytes(1e9, 8, False, Assumptions(bytes_per_param=18)) == pytest.approx(18e9)
    assert costs.state_bytes(1e9, 8, False, Assumptions(bytes_per_param=20)) == pytest.approx(20e9)
    assert costs.state_bytes(1e9, 8, True, Assumptions()) == pytest.approx((4 + 12 / 8) * 1e9)
    with pytest.raises(ValueError):
        Assumptions(bytes_per_param=17)


def test_usable_memory():
    a = Assumptions(memory_margin=0.1, memory_reserve_gib=1.0)
    assert costs.usable_memory(A100, a) == pytest.approx(80 * 2**30 * 0.9 - 2**30)


def test_model_flops_match_megatron_formula():
    m = TransformerShape("x", "gpt", 96, 12288, 96, 4 * 12288, 51200, 2048, 64)
    B, s, l, h, V = 64, 2048, 96, 12288, 51200
    megatron = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert costs.model_flops_per_iteration(m) == pytest.approx(megatron, rel=1e-9)


def test_parameter_counts():
    h, f = GPT.hidden, GPT.ffn
    assert GPT.layer_params(1) == 4 * h * h + 2 * h * f + 3 * h + h + f + h + 4 * h
    assert preset("gpt2-1.5b").total_params() == pytest.approx(1.558e9, rel=2e-3)
    assert preset("llama-2-7b").total_params() == pytest.approx(6.738e9, rel=2e-3)
    assert preset("llama-2-70b").total_params() == pytest.approx(68.98e9, rel=2e-3)
    # sharding: matrices split over tp, norms and row biases replicated
    assert GPT.layer_params(4) == pytest.approx((4 * h * h + 2 * h * f + 3 * h + f) / 4 + h + h + 4 * h)


def test_bf16_on_v100_is_refused():
    from computron.planner.errors import PlannerError

    with pytest.raises(PlannerError, match="bfloat16"):
        GPU_TYPES["v100"].peak_flops("bfloat16")
    assert math.isclose(GPU_TYPES["v100"].peak_flops("float16"), 125e12)


def test_gemm_efficiency_saturates_in_the_smallest_dimension():
    a = Assumptions(gemm_half_dim=64.0)
    # smallest dimension 64 -> half the asymptote; 192 -> 3/4; whichever of M, K, N is smallest
    assert costs.gemm_efficiency(A100, 4096, 64, 4096, a) == pytest.approx(0.87 * 0.5)
    assert costs.gemm_efficiency(A100, 192, 8192, 8192, a) == pytest.approx(0.87 * 0.75)
    assert costs.gemm_efficiency(A100, 8192, 8192, 192, a) == pytest.approx(0.87 * 0.75)
    assert costs.gemm_efficiency(A100, 1e9, 1e9, 1e9, a) == pytest.approx(0.87, rel=1e-6)
    assert costs.gemm_efficiency(A100, 128, 128, 128, Assumptions(gemm_half_dim=0.0)) == pytest.approx(0.87)


def test_layer_gemm_shapes_by_hand():
    b, t, s, h, f, d = 2, 4, 512, 1024, 4096, 64
    got = {name: (n, M, K, N) for name, n, M, K, N in costs.layer_gemm_shapes(GPT, t, b)}
    assert got == {"qkv": (1, b * s, h, 3 * h / t), "proj": (1, b * s, h / t, h), "mlp_up": (1, b * s, h, f / t),
                   "mlp_down": (1, b * s, f / t, h), "scores": (b * 16 / t, s, d, s), "context": (b * 16 / t, s, s, d)}


def test_layer_compute_uses_each_shape_efficiency():
    """Forward GEMM time by hand: each product at its own efficiency (attention's, limited by the
    head size d=64, at half the asymptote), so a smaller micro-batch or a higher tp is less efficient."""
    a = Assumptions(kernel_overhead_s=0.0, gemm_half_dim=64.0)
    m = replace(GPT, dropout=False)
    b, t, s, h, f, d, e = 1, 2, 512, 1024, 4096, 64, 2
    peak, hbm = 312e12 * 0.87, 2039e9 * a.hbm_eff

    def k(M, K, N, n=1):
        eff = min(M, K, N) / (min(M, K, N) + 64.0)
        return max(n * 2 * M * K * N / (peak * eff), n * e * (M * K + K * N + M * N) / hbm)

    M = b * s
    gemm = k(M, h, 3 * h / t) + k(M, h / t, h) + k(M, h, f / t) + k(M, f / t, h) + k(s, d, s, 8) + k(s, s, d, 8)
    elem = costs.elementwise_bytes(m, t, b) / hbm
    fwd, bwd = costs.layer_compute(m, A100, t, b, a)
    assert fwd == pytest.approx(gemm + elem)
    assert bwd == pytest.approx(2 * gemm + 2 * elem)
    # per sample, micro-batch 1 is slower than 4 (M = 512 vs 2048 limits the M-bound products)
    big = costs.layer_compute(m, A100, 8, 4, a)[0] / 4
    small = costs.layer_compute(m, A100, 8, 1, a)[0]
    assert small > big


def test_straggler_factor_is_expected_max_of_normals():
    from statistics import NormalDist

    a = Assumptions(dp_jitter=0.05)
    assert costs.straggler_factor(1, a) == 0.0
    assert costs.straggler_factor(8, Assumptions(dp_jitter=0.0)) == 0.0
    # Blom: Phi^-1((n - 0.375) / (n + 0.25)); 2 replicas: E[max of 2 normals] = 1/sqrt(pi) = 0.564
    assert costs.straggler_factor(2, a) == pytest.approx(0.05 * NormalDist().inv_cdf(1.625 / 2.25))
    assert costs.straggler_factor(2, a) == pytest.approx(0.05 / math.pi ** 0.5, rel=0.05)  # Blom is 4% high at 2
    assert costs.straggler_factor(32, a) == pytest.approx(0.05 * 2.07, rel=0.01)  # tabulated E[max of 32] = 2.07
    xs = [costs.straggler_factor(2 ** k, a) for k in range(1, 10)]
    steps = [y - x for x, y in zip(xs, xs[1:])]
    assert all(d > 0 for d in steps) and steps == sorted(steps, reverse=True)  # grows per doubling, ever less


@pytest.mark.parametrize("t", [2, 4, 8])
def test_sequence_parallel_and_selective_memory_are_korthikanti(t):
    """Korthikanti et al. 2022, Table 2: sbh(34/t + 5as/(ht)) with sequence parallelism,
    sbh(10 + 24/t) with selective recomputation, sbh*34/t with both; 2sbh/t kept per layer with
    full recomputation and sequence parallelism."""
    b, s, h, a = 3, GPT.seq_len, GPT.hidden, GPT.heads
    sbh = s * b * h
    assert costs.activation_bytes(GPT, t, b, sp=True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert costs.activation_bytes(GPT, t, b, selective=True) == pytest.approx(sbh * (10 + 24 / t))
    assert costs.activation_bytes(GPT, t, b, sp=True, selective=True) == pytest.approx(sbh * 34 / t)
    assert costs.layer_input_bytes(GPT, b, t, sp=True) == pytest.approx(2 * sbh / t)


def test_sequence_parallel_divides_the_replicated_elementwise_traffic():
    M, h, e, t = 512, 1024, 2, 4
    shard = 2 * e * M * 4096 / t + 4.5 * e * 16 / t * 512 * 512
    assert costs.elementwise_bytes(GPT, t, 1, sp=True) == pytest.approx(15 * e * M * h / t + shard)
    assert costs.elementwise_bytes(GPT, t, 1) == pytest.approx(15 * e * M * h + shard)


def test_selective_recompute_time_is_the_attention_core_forward():
    a = Assumptions(kernel_overhead_s=0.0, gemm_half_dim=64.0)
    t, b, s, d, e = 2, 1, 512, 64, 2
    heads = b * 16 / t
    eff = 0.87 * d / (d + 64.0)
    gemm = 2 * max(heads * 2 * s * s * d / (312e12 * eff), heads * e * (2 * s * d + s * s) / (2039e9 * a.hbm_eff))
    soft = 4.5 * e * heads * s * s / (2039e9 * a.hbm_eff)
    assert costs.attention_core_forward(GPT, A100, t, b, a) == pytest.approx(gemm + soft)
    assert costs.attention_core_forward(replace(GPT, flash_attention=True), A100, t, b, a) == 0.0


def test_state_bytes_by_zero_stage():
    P, n = 1e9, 8
    a = Assumptions()
    assert costs.state_bytes(P, n, 0, a) == pytest.approx(16e9)
    assert costs.state_bytes(P, n, True, a) == costs.state_bytes(P, n, 1, a) == pytest.approx((2 + 2 + 12 / n) * P)
    assert costs.state_bytes(P, n, 2, a) == pytest.approx((2 + (2 + 12) / n) * P)
    assert costs.state_bytes(P, n, 3, a) == pytest.approx(16 / n * P)
    assert costs.state_bytes(P, n, 2, Assumptions(bytes_per_param=20)) == pytest.approx((2 + (6 + 12) / n) * P)
    # fp8 weights (fp8_param_gather, NVIDIA's fp8 recipes): the fp8 weight and its transpose, 1 byte
    # each, replace the 16-bit weight; a ZeRO-3 shard holds only its fp8 bytes
    assert costs.state_bytes(P, n, 1, a, fp8=True) == pytest.approx((1 + 1 + 2 + 12 / n) * P)
    assert costs.state_bytes(P, n, 3, a, fp8=True) == pytest.approx((1 + 2 + 12) / n * P)
    # without (Megatron-LM's default) they are cached next to the 16-bit weight
    b = Assumptions(fp8_params=False)
    assert costs.state_bytes(P, n, 1, b, fp8=True) == pytest.approx((2 + 2 + 12 / n + 2) * P)
    assert costs.state_bytes(P, n, 3, b, fp8=True) == pytest.approx(16 / n * P)
    # stage 3 gathers two layers (16-bit, or fp8 + transpose; 4 bytes with both) and, on the end
    # stages, the 16-bit embedding or head
    assert costs.zero_working_bytes(10.0, 5.0, 1, a) == 0.0
    assert costs.zero_working_bytes(10.0, 5.0, 2, a) == pytest.approx(10 * 2)
    assert costs.zero_working_bytes(10.0, 5.0, 3, a) == pytest.approx(10 * 2 + 25 * 2)
    assert costs.zero_working_bytes(10.0, 5.0, 3, a, fp8=True) == pytest.approx(10 * 2 + 25 * 2)
    assert costs.zero_working_bytes(10.0, 5.0, 3, b, fp8=True) == pytest.approx(10 * 2 + 20 * 4 + 5 * 2)


def test_dp_sync_by_zero_stage_is_the_zero_papers_volume():
    P, n, bw = 1e9, 8, 1e10
    a = Assumptions()
    half = 7 / 8 * 2e9 / bw  # one reduce-scatter or all-gather of P 2-byte elements
    assert costs.dp_allreduce(P, n, bw, 0.0, a, 0) == pytest.approx(2 * half)
    assert costs.dp_allreduce(P, n, bw, 0.0, a, 1) == pytest.approx(2 * half)  # the same 2 Psi
    assert costs.dp_allreduce(P, n, bw, 0.0, a, 2) == pytest.approx(half)  # grads went during the backward
    assert costs.dp_allreduce(P, n, bw, 0.0, a, 3) == 0.0
    # fp32 gradients: reduce-scatter 4 bytes, all-gather the 2-byte weights
    assert costs.dp_allreduce(P, n, bw, 0.0, Assumptions(bytes_per_param=18), 1) == pytest.approx(3 * half)
    assert costs.dp_allreduce(P, n, bw, 1e-5, a, 1) == pytest.approx(costs.ring_allreduce(2 * P, n, bw, 1e-5))
    # per layer per micro-batch: stage 2 reduce-scatters in backward; 3 also gathers twice: 3 Psi
    assert costs.zero_layer_comm(P, n, bw, 0.0, 1, a) == (0.0, 0.0)
    assert costs.zero_layer_comm(P, n, bw, 0.0, 2, a) == pytest.approx((0.0, half))
    f, b = costs.zero_layer_comm(P, n, bw, 0.0, 3, a)
    assert (f, b) == pytest.approx((half, 2 * half)) and f + b == pytest.approx(3 * half)
    assert costs.optimizer_step(1e9, A100, 4, 2, Assumptions(kernel_overhead_s=0.0)) == pytest.approx(
        1e9 / 4 * 40 / (2039e9 * 0.8))
    # fp8 weights are gathered in 1 byte (fp8_param_gather): stage 1's all-gather halves
    assert costs.weight_gather_bytes(True, 2, a) == 1 and costs.weight_gather_bytes(False, 2, a) == 2
    assert costs.weight_gather_bytes(True, 2, Assumptions(fp8_params=False)) == 2
    assert costs.dp_allreduce(P, n, bw, 0.0, a, 1, gathered=P * 1) == pytest.approx(1.5 * half)


def test_fsdp2_copies_by_hand():
    """ZeRO-3 as FSDP2 runs it: per micro-batch a layer's gathered weights are copied out of the
    all-gather buffer before its forward and again before its backward (read + write 2 bytes a
    parameter each), and its gradients copied into the reduce-scatter buffer (read 2, write the
    reduce dtype's g); memory-bound at hbm_bw * hbm_eff."""
    h100, P = GPU_TYPES["h100"], 855_638_016  # one Llama 3 70B layer at tp 1
    bw = 3350e9 * 0.8
    a = Assumptions()
    f, b = costs.zero3_copy_time(P, h100, a)
    assert f == pytest.approx(4 * P / bw) and f == pytest.approx(1.2771e-3, rel=1e-4)
    assert b == pytest.approx((4 + 2 + 2) * P / bw)
    f18, b18 = costs.zero3_copy_time(P, h100, Assumptions(bytes_per_param=18))  # fp32 reduce: write 4
    assert f18 == f and b18 == pytest.approx((4 + 2 + 4) * P / bw)
    assert costs.zero3_copy_time(P, h100, a, e_w=1) == pytest.approx((2 * P / bw, (2 + 4) * P / bw))
    assert costs.zero3_copy_time(P, h100, Assumptions(zero3_copies=False)) == (0.0, 0.0)


def test_embedding_keeps_only_token_ids_and_dropout_mask():
    # its output is the first layer's input, counted there (Korthikanti et al. 2022, Section 4.3)
    llama = preset("llama-3-70b")
    assert costs.embedding_activation_bytes(llama, 1) == 8 * 8192
    g = preset("gpt3-175b")
    assert costs.embedding_activation_bytes(g, 2) == 8 * 4096 + 4096 * 12288
    assert costs.embedding_activation_bytes(g, 2, 8, sp=True) == 8 * 4096 + 4096 * 12288 / 8


def test_context_parallel_attention_and_ring():
    m = replace(GPT, flash_attention=True, seq_len=4096)
    local = m.context_shard(4)
    assert local.seq_len == 1024 and local.layer_params(2) == m.layer_params(2)
    full, _ = costs.flash_attention_fwd(m, 2, 1)
    part, by = costs.flash_attention_fwd(local, 2, 1, cp=4)
    assert part == pytest.approx(full / 4)  # each rank: a quarter of the causal work
    assert by == pytest.approx(8 * 2 * (2 + 8) * 1024 * 64)  # its Q, O and every K, V block
    # the ring: 3 steps of 2*b*(s/cp)*k*d*e bytes, hidden behind the attention
    step = 2 * 1024 * 8 * 64 * 2 / 1e9 + 1e-6
    assert costs.cp_ring_exposed(local, 2, 1, 4, 0.0, 1e9, 1e-6) == pytest.approx((3 * step, 6 * step))
    assert costs.cp_ring_exposed(local, 2, 1, 4, 3 * step, 1e9, 1e-6) == pytest.approx((0.0, 0.0))
    assert costs.cp_ring_exposed(local, 2, 1, 4, step, 1e9, 1e-6) == pytest.approx((2 * step, 3.5 * step))
    assert costs.cp_ring_exposed(m, 2, 1, 1, 0.0, 1e9, 1e-6) == (0.0, 0.0)
    # a rank's activations are those of its s/cp tokens
    assert costs.activation_bytes(local, 2, 1) < costs.activation_bytes(m, 2, 1) / 3.9


def test_fp8_gemms_at_the_fp8_rate_with_their_casts():
    h100 = GPU_TYPES["h100"]
    assert h100.fp8_tflops == 1979.0 and GPU_TYPES["h200"].fp8_tflops == 1979.0 and not A100.fp8_tflops
    with pytest.raises(ValueError, match="no fp8"):
        costs.layer_parts(GPT, A100, 1, 1, fp8=True)
    a = Assumptions(kernel_overhead_s=0.0)
    big = TransformerShape("b", "llama", 1, 8192, 64, 28672, 32000, 4096, 8, kv_heads=8, dtype="bfloat16")
    lo, hi = costs.layer_parts(big, h100, 1, 1, a, fp8=True), costs.layer_parts(big, h100, 1, 1, a)
    name, n, M, K, N = costs.layer_gemm_shapes(big, 1, 1)[2]  # mlp_up, compute-bound
    eff = costs.gemm_efficiency(h100, M, K, N, a)
    assert hi[name] == pytest.approx(2 * M * K * N / (989e12 * eff))
    assert lo[name] == pytest.approx(2 * M * K * N / (1979e12 * eff * a.fp8_eff_ratio))
    assert lo["attn"] == hi["attn"]  # attention stays in 16 bits
    casts = 3 * 4096 * (8192 + 8192 + 8192 + 28672)  # (e + 1) bytes per GEMM input element
    assert (lo["elem"] - hi["elem"]) * h100.hbm_bw * a.hbm_eff == pytest.approx(casts)


def test_tp_overlap_hides_each_half_behind_its_gemm():
    a = Assumptions()
    x = costs.tp_allreduce(GPT, 4, 1, 300e9, a)
    assert costs.layer_tp_comm(GPT, 4, 1, 300e9, a) == pytest.approx((2 * x, 2 * x))
    big = {n: 1.0 for n in costs.LINEAR}
    assert costs.layer_tp_comm(GPT, 4, 1, 300e9, a, big) == (0.0, 0.0)  # every half hidden
    none = {n: 0.0 for n in costs.LINEAR}
    assert costs.layer_tp_comm(GPT, 4, 1, 300e9, a, none) == pytest.approx((2 * x, 2 * x))
    some = dict(none, qkv=x / 4)  # hides half of one half forward, all of it backward (2x window)
    assert costs.layer_tp_comm(GPT, 4, 1, 300e9, a, some) == pytest.approx((2 * x - x / 4, 2 * x - x / 2))


def test_fp8_keeps_the_gemm_inputs_in_one_byte():
    m = preset("llama-2-70b")
    t, b, s, h, f = 8, 1, m.seq_len, m.hidden, m.ffn
    M = b * s
    for sp in (False, True):
        saved = costs.activation_bytes(m, t, b, sp) - costs.activation_bytes(m, t, b, sp, fp8=True)
        # QKV and MLP-up inputs and the MLP-down input in 1 byte; the fused attention keeps its
        # 16-bit output, so the projection's fp8 copy of it adds a byte
        assert saved == pytest.approx(M * (2 * h / (t if sp else 1) + f / t - h / t))
    # unfused attention keeps no copy of its output: the projection's fp8 copy replaces it
    g = preset("gpt3-13b")
    saved = costs.activation_bytes(g, 8, 1) - costs.activation_bytes(g, 8, 1, fp8=True)
    assert saved == pytest.approx(g.seq_len * (2 * g.hidden + g.hidden / 8 + g.ffn / 8))


def test_fp8_llama3_70b_layer_by_hand():
    """The published fp8 run's layer (Llama 3 70B, tp 4, sequence parallelism, 8,192 tokens),
    counted by hand in bytes per token: norm inputs 2 x 2h/4, QKV and MLP-up inputs in fp8 2 x h/4,
    Q 2h/4, K and V 2 x 2 x 256, O 2h/4 + its fp8 copy h/4, SwiGLU input 2 x 2f/4, MLP-down input
    in fp8 f/4; plus fused attention's 4-byte log-sum-exp per query and head."""
    m = preset("llama-3-70b")
    h, f, s = 8192, 28672, 8192
    per_token = 2 * 2 * h / 4 + 2 * h / 4 + 2 * h / 4 + 2 * 2 * 2 * 128 + 2 * h / 4 + h / 4 + 2 * 2 * f / 4 + f / 4
    assert per_token == 59392
    assert costs.activation_bytes(m, 4, 1, sp=True, fp8=True) == pytest.approx(s * per_token + 4 * 16 * s)
