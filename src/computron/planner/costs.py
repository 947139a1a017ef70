"""The cost model: small pure functions, one formula each (seconds, bytes, FLOPs).

What flows through: a :class:`~computron.planner.model.TransformerShape`, a GPU type, the TP degree
``t`` and micro-batch size ``b`` go in; seconds (or bytes) come out. Nothing here knows about
stages, schedules or placements: estimate.py composes these into a plan's time.

Notation: s sequence length, h hidden, a heads, d = h/a, k K/V heads per TP rank, f FFN size,
V vocabulary, e bytes per element (2 for fp16/bf16), M = b*s tokens in a micro-batch.
Every assumed constant lives in :class:`Assumptions`; docs/planner.md gives its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

from .hardware import GpuType
from .model import TransformerShape


@dataclass(frozen=True)
class Assumptions:
    """Every assumed parameter of the cost model (see docs/planner.md for each one's source)."""

    hbm_eff: float = 0.80  # sustained fraction of HBM bandwidth in elementwise kernels
    kernel_overhead_s: float = 4e-6  # per kernel: launch gap + tail of the last wave
    flash_eff_ratio: float = 0.75  # fused attention efficiency relative to the GPU's GEMM efficiency
    intra_eff: float = 0.80  # NCCL bus bandwidth / nominal NVLink or PCIe bandwidth
    inter_eff: float = 0.85  # NCCL bus bandwidth / nominal NIC bandwidth
    intra_latency_s: float = 2e-6  # per ring step inside a node
    inter_latency_s: float = 6e-6  # per ring step across nodes
    p2p_latency_s: float = 20e-6  # one pipeline send/recv handshake (blocking batched isend/irecv)
    bytes_per_param: int = 16  # 16: fp16 w+g, fp32 master+m+v; 18: fp32 grads; 20: both grads
    optimizer_traffic_bytes: float = 40.0  # HBM bytes moved per parameter by unscale+norm+Adam
    memory_margin: float = 0.10  # fraction of GPU memory kept free (fragmentation, workspaces)
    memory_reserve_gib: float = 1.0  # CUDA context + NCCL buffers
    scatter_gather: bool = True  # Megatron's p2p scatter/gather over TP ranks
    # fitted on the calibration rows of bench/plan_validate_megatron.py (docs/planner.md, Accuracy)
    gemm_half_dim: float = 160.0  # GEMM dimension at which efficiency is half of the GPU's asymptote
    chunk_overhead_s: float = 1.5e-3  # per pipeline chunk op (forward or backward), pp > 1: its
    # blocking send/recv rendezvous, stream waits and the schedule's host-side step; interleaving
    # with v chunks pays it v times per micro-batch where plain 1F1B pays it once
    dp_jitter: float = 0.03  # relative spread (std) of one data-parallel replica's pipeline time

    def __post_init__(self) -> None:
        if self.bytes_per_param not in (16, 18, 20):
            raise ValueError(f"bytes_per_param must be 16, 18 or 20, got {self.bytes_per_param}")

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element held and all-reduced: fp16 for 16, fp32 main grads otherwise."""
        return 2 if self.bytes_per_param == 16 else 4


DEFAULT = Assumptions()
_NORMAL = NormalDist()


# ---------------------------------------------------------------- compute (roofline)
def roofline(flops: float, nbytes: float, gpu: GpuType, dtype: str, a: Assumptions, eff: float | None = None) -> float:
    """One kernel: ``max(F / (peak * eff), bytes / (hbm_bw * hbm_eff)) + kernel_overhead``."""
    peak = gpu.peak_flops(dtype) * (gpu.gemm_eff if eff is None else eff)
    return max(flops / peak, nbytes / (gpu.hbm_bw * a.hbm_eff)) + a.kernel_overhead_s


def gemm_efficiency(gpu: GpuType, M: float, K: float, N: float, a: Assumptions = DEFAULT) -> float:
    """Sustained fraction of peak of one (M x K) @ (K x N) product: ``gemm_eff * n / (n + n_half)``,
    n = min(M, K, N), n_half = ``a.gemm_half_dim``.

    Why this form: a GEMM runs as output tiles of (typically) 128 x 128 or 128 x 256, each looping
    over K in steps of 32-64. The smallest dimension sets how much of that work is fixed cost per
    tile: a short K loop is dominated by the prologue (loading the first tiles) and epilogue
    (writing C); a narrow M or N leaves tiles partly empty and too few tiles to fill the SMs. The
    useful work grows with n while the fixed part does not, which gives the saturating ``n/(n +
    n_half)``; large products approach the GPU's ``gemm_eff``. Memory-bound shapes are handled by the
    roofline's byte term, not here. So attention products with a head size of 64-128, the output
    projection at high tp (K = h/t) and small micro-batches (M = b*s) run below the asymptote.
    """
    n = min(M, K, N)
    return gpu.gemm_eff * n / (n + a.gemm_half_dim)


def layer_gemm_shapes(m: TransformerShape, t: int, b: int) -> list[tuple[str, float, float, float, float]]:
    """Forward GEMMs of one layer on one TP rank: ``(name, batch, M, K, N)``.

    QKV: M x h x (h/t + 2kd); out: M x h/t x h; MLP: M x h x f/t (twice when gated, one product)
    and M x f/t x h, with M = b*s. Attention core without fusion, b*a/t batched products per layer:
    scores s x d x s and context s x s x d.
    """
    s, h, d = m.seq_len, m.hidden, m.head_dim
    M = b * s
    qkv_n = m.heads // t * d + 2 * m.kv_heads_per_rank(t) * d
    f = m.ffn / t
    up_n = f * (2 if m.gated else 1)
    out = [("qkv", 1, M, h, qkv_n), ("proj", 1, M, h / t, h), ("mlp_up", 1, M, h, up_n), ("mlp_down", 1, M, f, h)]
    if not m.flash_attention:
        heads = b * m.heads / t
        out += [("scores", heads, s, d, s), ("context", heads, s, s, d)]
    return out


def gemm_cost(batch: float, M: float, K: float, N: float, e: int) -> tuple[float, float]:
    """(FLOPs, bytes) of ``batch`` products M x K x N: ``2*M*K*N`` and ``e*(MK + KN + MN)`` each."""
    return batch * 2.0 * M * K * N, batch * e * (M * K + K * N + M * N)


def layer_gemms(m: TransformerShape, t: int, b: int) -> list[tuple[str, float, float]]:
    """Forward GEMMs of one layer on one TP rank: ``(name, FLOPs, bytes)``, FLOPs = 2*M*K*N
    (shapes from :func:`layer_gemm_shapes`). Attention core without fusion: scores and context,
    each 2*b*(a/t)*s^2*d FLOPs."""
    return [(name, *gemm_cost(n, M, K, N, m.bytes_per_elem)) for name, n, M, K, N in layer_gemm_shapes(m, t, b)]


def flash_attention_fwd(m: TransformerShape, t: int, b: int) -> tuple[float, float]:
    """Fused causal attention: ``FLOPs = 4*b*(a/t)*s^2*d / 2`` (masked blocks skipped), bytes of Q,K,V,O."""
    heads = b * m.heads / t
    s, d = m.seq_len, m.head_dim
    return heads * 4.0 * s * s * d * 0.5, heads * m.bytes_per_elem * 4 * s * d


def elementwise_bytes(m: TransformerShape, t: int, b: int, sp: bool = False) -> float:
    """HBM traffic of one layer's non-GEMM forward kernels on one TP rank (bytes).

    Replicated over TP (no sequence parallelism): 2 norms (read+write, 4*Mh), 2 residual adds
    (6*Mh) and, with dropout, 2 dropouts (5*Mh incl. 1-byte masks) -> 15 (GPT) or 10 (Llama) x e*M*h.
    Sharded: the MLP activation (2*M*f/t r+w, 3 when gated), RoPE on Q and K (Llama), and the
    score softmax + dropout without fusion (2 + 2.5 x b*(a/t)*s^2 elements). With sequence
    parallelism (``sp``) the replicated part runs on s/t of the sequence on each rank: divided by t.
    """
    e, s, h = m.bytes_per_elem, m.seq_len, m.hidden
    M = b * s
    rep = (15 if m.dropout else 10) * e * M * h / (t if sp else 1)
    sh = (3 if m.gated else 2) * e * M * m.ffn / t
    if m.family == "llama":
        sh += 2 * e * M * (m.heads // t + m.kv_heads_per_rank(t)) * m.head_dim
    if not m.flash_attention:
        sh += (4.5 if m.dropout else 2.0) * e * b * m.heads / t * s * s
    return rep + sh


ELEMENTWISE_KERNELS = 8  # norms, residual adds, dropouts, activation, softmax: kernels per layer forward


def layer_compute(m: TransformerShape, gpu: GpuType, t: int, b: int, a: Assumptions = DEFAULT,
                  sp: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's compute on one TP rank, communication excluded.

    forward = sum of roofline(GEMM, at its shape's :func:`gemm_efficiency`) + fused attention + elementwise bytes / (hbm_bw * hbm_eff);
    backward = 2 x forward GEMMs (data and weight gradients) + 2.5 x fused attention (FlashAttention-2
    backward recomputes the scores) + 2 x elementwise traffic.
    """
    gemm = 0.0
    for _, n, M, K, N in layer_gemm_shapes(m, t, b):
        fl, by = gemm_cost(n, M, K, N, m.bytes_per_elem)
        gemm += roofline(fl, by, gpu, m.dtype, a, eff=gemm_efficiency(gpu, M, K, N, a))
    attn = 0.0
    if m.flash_attention:
        fl, by = flash_attention_fwd(m, t, b)
        attn = roofline(fl, by, gpu, m.dtype, a, eff=gpu.gemm_eff * a.flash_eff_ratio)
    elem = elementwise_bytes(m, t, b, sp) / (gpu.hbm_bw * a.hbm_eff) + ELEMENTWISE_KERNELS * a.kernel_overhead_s
    return gemm + attn + elem, 2 * gemm + 2.5 * attn + 2 * elem


def attention_core_forward(m: TransformerShape, gpu: GpuType, t: int, b: int, a: Assumptions = DEFAULT) -> float:
    """What selective recomputation (Korthikanti et al. 2022) runs again before the backward: the
    attention core's forward, scores and context products plus the softmax (and its dropout),
    ``(2 + 2.5) x e*b*(a/t)*s^2`` bytes with dropout, 2 without. Zero with fused attention, whose
    backward already recomputes the scores (and which keeps no s x s activations to drop)."""
    if m.flash_attention:
        return 0.0
    e, s = m.bytes_per_elem, m.seq_len
    out = 0.0
    for name, n, M, K, N in layer_gemm_shapes(m, t, b):
        if name in ("scores", "context"):
            fl, by = gemm_cost(n, M, K, N, e)
            out += roofline(fl, by, gpu, m.dtype, a, eff=gemm_efficiency(gpu, M, K, N, a))
    soft = (4.5 if m.dropout else 2.0) * e * b * m.heads / t * s * s
    return out + soft / (gpu.hbm_bw * a.hbm_eff) + (2 if m.dropout else 1) * a.kernel_overhead_s


def embedding_compute(m: TransformerShape, gpu: GpuType, t: int, b: int, a: Assumptions = DEFAULT) -> tuple[float, float]:
    """(fwd, bwd) of the input embedding: gather + position add + dropout, ~4 x e*M*h bytes each way."""
    x = 4 * m.bytes_per_elem * b * m.seq_len * m.hidden / (gpu.hbm_bw * a.hbm_eff) + 2 * a.kernel_overhead_s
    return x, x


def head_compute(m: TransformerShape, gpu: GpuType, t: int, b: int, a: Assumptions = DEFAULT) -> tuple[float, float]:
    """(fwd, bwd) of final norm + logits GEMM (M x h x V/t) + vocab-parallel cross entropy.

    Cross entropy reads/writes fp32 logits ~4 times forward and ~2 times backward: 16 and 8 bytes x M*V/t.
    """
    e, M, h = m.bytes_per_elem, b * m.seq_len, m.hidden
    n = m.vocab / t
    gemm = roofline(2.0 * M * h * n, e * (M * h + h * n + M * n), gpu, m.dtype, a, eff=gemm_efficiency(gpu, M, h, n, a))
    norm = 4 * e * M * h / (gpu.hbm_bw * a.hbm_eff)
    ce = M * n / (gpu.hbm_bw * a.hbm_eff)
    return gemm + norm + 16 * ce + 3 * a.kernel_overhead_s, 2 * gemm + 2 * norm + 8 * ce + 3 * a.kernel_overhead_s


# ---------------------------------------------------------------- communication
def ring_allreduce(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks: ``2(n-1)/n * bytes / bw + 2(n-1) * latency``.

    ``bw`` is the bus bandwidth of the slowest link the ring crosses (bytes/s, efficiency applied).
    """
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * latency


def tp_allreduce(m: TransformerShape, t: int, b: int, intra_bw: float, a: Assumptions = DEFAULT) -> float:
    """One Megatron TP all-reduce of the layer output (e*b*s*h bytes) over NVLink/PCIe inside a node."""
    nbytes = m.bytes_per_elem * b * m.seq_len * m.hidden
    return ring_allreduce(nbytes, t, intra_bw * a.intra_eff, a.intra_latency_s)


def layer_tp_comm(m: TransformerShape, t: int, b: int, intra_bw: float, a: Assumptions = DEFAULT) -> tuple[float, float]:
    """(fwd, bwd) TP communication of one layer: 2 all-reduces forward (after attention and MLP,
    Megatron's g), 2 backward (before QKV and MLP-up, Megatron's f)."""
    x = tp_allreduce(m, t, b, intra_bw, a)
    return 2 * x, 2 * x


def p2p_time(m: TransformerShape, t: int, b: int, link_bw: float, intra_bw: float, a: Assumptions = DEFAULT,
             crosses: bool = True) -> float:
    """Send one activation (E = e*b*s*h bytes) to the next stage: ``E/link_bw + p2p_latency``.

    Across nodes, with scatter/gather, each of the t ranks sends E/t over its own NIC share
    (``link_bw``, efficiency applied) and the receivers all-gather it over their intra-node links:
    ``(E/t)/link_bw + p2p_latency + (t-1)/t * E/(intra*intra_eff) + (t-1)*intra_latency``.
    """
    E = m.bytes_per_elem * b * m.seq_len * m.hidden
    if a.scatter_gather and t > 1 and crosses:
        gather = (t - 1) / t * E / (intra_bw * a.intra_eff) + (t - 1) * a.intra_latency_s
        return E / t / link_bw + a.p2p_latency_s + gather
    return E / link_bw + a.p2p_latency_s


def dp_allreduce(params_rank: float, dp: int, bw: float, latency: float, a: Assumptions = DEFAULT) -> float:
    """Gradient all-reduce of one stage's TP shard over its dp replicas (ring, slowest link).

    With ZeRO-1 it is a reduce-scatter plus an all-gather: the same 2(n-1)/n volume.
    """
    return ring_allreduce(params_rank * a.grad_bytes, dp, bw, latency)


def straggler_factor(dp: int, a: Assumptions = DEFAULT) -> float:
    """Extra fraction of the pipeline time spent waiting for the slowest of ``dp`` replicas:
    ``dp_jitter * z(dp)``, z(n) = the expected maximum of n standard normal draws (Blom's
    approximation ``Phi^-1((n - 0.375) / (n + 0.25))``: 0 at n=1, 0.56 at 2, 1.27 at 6, 2.07 at 32).

    Why this form: data-parallel replicas are synchronous; each runs its own pipeline and all of
    them meet at the gradient all-reduce, so the iteration ends when the slowest finishes. One
    replica's pipeline time varies around the modelled one (GPU clocks and thermals differ
    between chips, its TP and p2p traffic meets different congestion in the fabric, host noise
    delays kernel launches). With a relative spread sigma per replica, the expected maximum over
    n replicas is ``mean * (1 + sigma * z(n))``: zero cost for one replica, growing with the count
    but ever more slowly (z grows like sqrt(2 ln n)). The ring's per-step latency, the other term
    that grows with n, is in :func:`ring_allreduce`.
    """
    if dp <= 1 or a.dp_jitter == 0.0:
        return 0.0
    return a.dp_jitter * _NORMAL.inv_cdf((dp - 0.375) / (dp + 0.25))


def embedding_sync(m: TransformerShape, t: int, bw: float, latency: float, a: Assumptions = DEFAULT) -> float:
    """Tied word embeddings with pp>1: all-reduce of the V*h/t gradient between the first and last
    stage (2 ranks: ``bytes / bw + 2*latency``)."""
    return ring_allreduce(m.vocab * m.hidden / t * a.grad_bytes, 2, bw, latency)


def optimizer_step(params_rank: float, gpu: GpuType, dp: int, zero1: bool, a: Assumptions = DEFAULT) -> float:
    """Mixed-precision Adam, memory-bound: ``P * optimizer_traffic_bytes / (hbm_bw * hbm_eff)``,
    P being the parameters this rank updates (its TP shard, divided by dp with ZeRO-1)."""
    n = params_rank / dp if zero1 else params_rank
    return n * a.optimizer_traffic_bytes / (gpu.hbm_bw * a.hbm_eff) + 10 * a.kernel_overhead_s


# ---------------------------------------------------------------- memory
def activation_bytes(m: TransformerShape, t: int, b: int, sp: bool = False, selective: bool = False) -> float:
    """Activations one layer keeps for backward, per micro-batch, per TP rank (Korthikanti et al. 2022).

    GPT with dropout and standard attention gives ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``. In general:
    replicated ``e*M*4h`` (norm, QKV and MLP inputs) + ``2*M*h`` masks (dropout); sharded
    ``e*M*(2h/t + 2kd)`` (Q, K, V, attention output) + ``e*M*f/t`` x 2 (GeLU in/out) or x 3 (gated);
    scores ``b*(a/t)*s^2*(2e+1)`` with dropout, ``e`` without, none with fused attention (it keeps
    a 4-byte log-sum-exp per row instead).

    Sequence parallelism (``sp``) shards the replicated part over the t ranks along the sequence;
    selective recomputation drops the scores (recomputed, :func:`attention_core_forward`). For GPT
    these give Korthikanti's ``sbh(34/t + 5as/(ht))``, ``sbh(10 + 24/t)`` and ``sbh * 34/t``.
    """
    e, s, h = m.bytes_per_elem, m.seq_len, m.hidden
    M = b * s
    rep = (e * M * 4 * h + (2 * M * h if m.dropout else 0)) / (t if sp else 1)
    sh = e * M * (2 * h / t + 2 * m.kv_heads_per_rank(t) * m.head_dim) + e * M * m.ffn / t * (3 if m.gated else 2)
    heads = b * m.heads / t
    if m.flash_attention:
        sc = 4 * heads * s
    elif selective:
        sc = 0.0
    else:
        sc = heads * s * s * ((2 * e + 1) if m.dropout else e)
    return rep + sh + sc


def layer_input_bytes(m: TransformerShape, b: int, t: int = 1, sp: bool = False) -> float:
    """With full recomputation a layer keeps only its input, ``e*b*s*h`` (replicated over TP; with
    sequence parallelism each rank keeps s/t of it: divided by t)."""
    return m.bytes_per_elem * b * m.seq_len * m.hidden / (t if sp else 1)


def embedding_activation_bytes(m: TransformerShape, b: int) -> float:
    """First stage: embedding output (+ its dropout mask)."""
    M = b * m.seq_len
    return m.bytes_per_elem * M * m.hidden + (M * m.hidden if m.dropout else 0)


def head_activation_bytes(m: TransformerShape, t: int, b: int) -> float:
    """Last stage: logits (e bytes) and their fp32 copy for the loss, ``(e + 4) * M * V/t``."""
    return (m.bytes_per_elem + 4) * b * m.seq_len * m.vocab / t


def state_bytes(params_rank: float, dp: int, zero1: bool, a: Assumptions = DEFAULT) -> float:
    """Weights, gradients and Adam state per rank: ``P * bytes_per_param``; ZeRO-1 divides the
    12 optimizer bytes (fp32 master, m, v) by dp."""
    opt = 12.0
    rest = a.bytes_per_param - opt
    return params_rank * (rest + (opt / dp if zero1 else opt))


def usable_memory(gpu: GpuType, a: Assumptions = DEFAULT) -> float:
    """Memory a plan may fill: ``capacity * (1 - margin) - reserve``."""
    return gpu.memory * (1 - a.memory_margin) - a.memory_reserve_gib * 1024**3


# ---------------------------------------------------------------- FLOP accounting (for reports)
def model_flops_per_iteration(m: TransformerShape) -> float:
    """Model FLOPs of one iteration (fwd+bwd = 3x forward, no recomputation), full s^2 attention:
    ``3 * B * (L * (2*M*P_matmul + 4*s^2*h) + 2*s*h*V)`` with M = s (per sequence)."""
    s, h = m.seq_len, m.hidden
    d, kv = m.head_dim, m.kv
    mat = h * (h + 2 * kv * d) + h * h + h * m.ffn * (3 if m.gated else 2)
    fwd = m.layers * (2.0 * s * mat + 4.0 * s * s * h) + 2.0 * s * h * m.vocab
    return 3.0 * m.global_batch * fwd
