"""The cost model: small pure functions, one formula each (seconds, bytes, FLOPs).

What flows through: a :class:`~computron.planner.model.TransformerShape`, a GPU type, the TP degree
``t`` and micro-batch size ``b`` go in; seconds (or bytes) come out. Nothing here knows about
stages, schedules or placements: estimate.py composes these into a plan's time.

Notation: s sequence length, h hidden, a heads, d = h/a, k K/V heads per TP rank, f FFN size,
V vocabulary, e bytes per element (2 for fp16/bf16), M = b*s tokens in a micro-batch.
Context parallelism (cp ranks share each sequence) reaches these functions as a shape whose
``seq_len`` is already s/cp (:meth:`TransformerShape.context_shard`); only the fused attention,
whose queries still see every key, is told ``cp``.
Every assumed constant lives in :class:`Assumptions`; docs/planner.md gives its reason.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    tp_collective_s: float = 0.0  # per tensor-parallel all-reduce inside a step, beyond its ring time:
    # the host's issue of the collective (autograd function, c10d call, NCCL launch) and the wait for
    # the slowest rank of the group to arrive; the profile times a layer's shard without either
    tp_collective_by_tp: tuple[tuple[int, float], ...] = ()  # (tp, seconds) pairs measured for this run's
    # tensor-parallel sizes (``train/tpcoll.py``), each in place of ``tp_collective_s`` at its tp
    bytes_per_param: int = 16  # 16: fp16 w+g, fp32 master+m+v; 18: fp32 grads; 20: both grads
    optimizer_traffic_bytes: float = 40.0  # HBM bytes moved per parameter by unscale+norm+Adam
    # How the training runtime holds its memory; the defaults are Megatron-LM's, the alternatives
    # what ``computron train`` does (``train/accuracy.py assumptions``, docs/planner.md):
    zero_shards_master: bool = True  # ZeRO-1 shards the fp32 master with the Adam moments (Megatron's
    # distributed optimizer); False: only the moments (8 bytes), every rank keeping every master
    # (torch's ZeroRedundancyOptimizer over fp32 parameters)
    keep_pipeline_outputs: bool = False  # the last pipeline stage keeps every micro-batch's logits
    # until the step ends and concatenates them there (torch.distributed.pipelining's return_outputs)
    step_transients: bool = False  # the peaks outside the activations' of a runtime that frees the
    # gradients between steps (none while the first micro-batch runs), takes each micro-batch's whole
    # 16-bit gradient at once without a pipeline (autograd.grad) and all-reduces the data-parallel
    # gradients through one flat copy of them (:func:`estimate.stage_memory`)
    unfused_llama: bool = False  # the Llama layer as plain torch ops keep it (``models/transformer.py``):
    # the SwiGLU's SiLU output, the QKV output whole under RoPE's rotated Q and K, RMSNorm's fp32
    # 1/rms (:func:`activation_bytes`); False: Megatron's fused SwiGLU and RoPE
    paired_steps: bool = False  # a profiled layer's forward plus backward is its ``step_s`` (the two timed
    # back to back, the host free to run ahead of the device as in a step: ``planner/profile.py
    # measure``), split between the forward and backward ops as its separate timings split; False, or
    # a profile entry without ``step_s``: the separate timings, each between two synchronisations
    # (an upper bound where the host's launch time exceeds the device's: small or recomputed layers)
    graphed_steps: bool = False  # each micro-batch replays as CUDA graphs (a pipeline's: stage by stage)
    # (``computron train --cuda-graphs``): a profiled layer's forward plus backward is its ``graph_s``
    # (the two replayed as one graph: device time, no host launch), split as ``paired_steps`` splits,
    # and each tensor-parallel all-reduce costs its ring time plus ``tp_collective_graphed_s`` (or the
    # measured one of its tp) in place of the eager ``tp_collective_s`` (:meth:`graph_view`)
    tp_collective_graphed_s: float = 0.0
    tp_collective_graphed_by_tp: tuple[tuple[int, float], ...] = ()
    memory_margin: float = 0.10  # fraction of GPU memory kept free (fragmentation, workspaces)
    memory_reserve_gib: float = 1.0  # CUDA context + NCCL buffers
    scatter_gather: bool = True  # Megatron's p2p scatter/gather over TP ranks
    # fitted on the calibration rows of bench/plan_validate_megatron.py (docs/planner.md, Accuracy)
    gemm_half_dim: float = 160.0  # GEMM dimension at which efficiency is half of the GPU's asymptote
    chunk_overhead_s: float = 1.5e-3  # per pipeline chunk op (forward or backward), pp > 1: its
    # blocking send/recv rendezvous, stream waits and the schedule's host-side step; interleaving
    # with v chunks pays it v times per micro-batch where plain 1F1B pays it once
    dp_jitter: float = 0.03  # relative spread (std) of one data-parallel replica's pipeline time
    fp8_eff_ratio: float = 0.9  # fp8 GEMM efficiency relative to the GPU's bf16 GEMM efficiency
    # with fp8, the layers' weights live only as fp8 (plus the transpose Hopper's fp8 GEMMs need)
    # and are gathered in fp8: Megatron's fp8_param_gather, which NVIDIA's fp8 recipes set
    # (Megatron-Bridge's current- and delayed-scaling presets); False: a 16-bit weight plus cached
    # fp8 copies (Megatron-LM's default)
    fp8_params: bool = True
    # ZeRO-3 as PyTorch FSDP2 runs it (per-parameter sharding): every all-gather's output is copied
    # out into the parameters and every gradient copied into the reduce-scatter buffer, on the
    # compute stream (:func:`zero3_copy_time`); False: flat buffers whose views are the parameters
    zero3_copies: bool = True

    def __post_init__(self) -> None:
        if self.bytes_per_param not in (16, 18, 20):
            raise ValueError(f"bytes_per_param must be 16, 18 or 20, got {self.bytes_per_param}")

    def tp_collective_at(self, t: int) -> float:
        """The per-collective cost of a tensor-parallel group of ``t`` ranks: the measured one for ``t``
        when there is one, else ``tp_collective_s``."""
        for size, seconds in self.tp_collective_by_tp:
            if size == t:
                return seconds
        return self.tp_collective_s

    def graph_view(self) -> "Assumptions":
        """These assumptions as a graphed step sees them: the graphed per-collective costs of tensor
        parallelism in place of the eager ones."""
        return replace(self, tp_collective_s=self.tp_collective_graphed_s,
                       tp_collective_by_tp=self.tp_collective_graphed_by_tp)

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element held and all-reduced: fp16 for 16, fp32 main grads otherwise."""
        return 2 if self.bytes_per_param == 16 else 4


DEFAULT = Assumptions()
_NORMAL = NormalDist()


# ---------------------------------------------------------------- compute (roofline)
def roofline(flops: float, nbytes: float, gpu: GpuType, dtype: str, a: Assumptions, eff: float | None = None,
             fp8: bool = False) -> float:
    """One kernel: ``max(F / (peak * eff), bytes / (hbm_bw * hbm_eff)) + kernel_overhead`` (``fp8``:
    the GPU's fp8 peak)."""
    peak = gpu.peak_flops(dtype, fp8) * (gpu.gemm_eff if eff is None else eff)
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


def flash_attention_fwd(m: TransformerShape, t: int, b: int, cp: int = 1) -> tuple[float, float]:
    """Fused causal attention: ``FLOPs = 4*b*(a/t)*s^2*d / 2`` (masked blocks skipped), bytes of Q,K,V,O.

    Under context parallelism ``m.seq_len`` is a rank's s/cp queries, which meet all cp*s/cp keys
    (load-balanced causal chunks give every rank the same half of the work): FLOPs times cp, K and
    V read once per ring step."""
    heads = b * m.heads / t
    s, d = m.seq_len, m.head_dim
    return heads * 4.0 * s * s * cp * d * 0.5, heads * m.bytes_per_elem * (2 + 2 * cp) * s * d


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


LINEAR = ("qkv", "proj", "mlp_up", "mlp_down")  # the layer's weight GEMMs (fp8 with ``fp8``)


def layer_parts(m: TransformerShape, gpu: GpuType, t: int, b: int, a: Assumptions = DEFAULT, sp: bool = False,
                cp: int = 1, fp8: bool = False) -> dict[str, float]:
    """Forward seconds of one layer's parts on one TP rank: each GEMM by name (roofline at its
    shape's :func:`gemm_efficiency`), ``attn`` (fused attention) and ``elem`` (elementwise bytes /
    (hbm_bw * hbm_eff) + kernel overheads).

    ``fp8`` (Transformer Engine's recipe): the four weight GEMMs run at the GPU's fp8 peak times
    ``gemm_efficiency * fp8_eff_ratio`` and read 1-byte inputs; attention, the head and the
    elementwise kernels stay in 16 bits; each GEMM input is cast to fp8 first (read e, write 1
    byte per element: the extra ``elem`` traffic); its backward casts the output gradients alike.
    """
    e = m.bytes_per_elem
    out = {}
    for name, n, M, K, N in layer_gemm_shapes(m, t, b):
        eff = gemm_efficiency(gpu, M, K, N, a)
        low = fp8 and name in LINEAR
        fl, by = gemm_cost(n, M, K, N, e)
        if low:
            by, eff = n * (M * K + K * N + e * M * N), eff * a.fp8_eff_ratio
        out[name] = roofline(fl, by, gpu, m.dtype, a, eff=eff, fp8=low)
    out["attn"] = 0.0
    if m.flash_attention:
        fl, by = flash_attention_fwd(m, t, b, cp)
        out["attn"] = roofline(fl, by, gpu, m.dtype, a, eff=gpu.gemm_eff * a.flash_eff_ratio)
    elem = elementwise_bytes(m, t, b, sp)
    kernels = ELEMENTWISE_KERNELS
    if fp8:
        shapes = {name: (M, K) for name, _, M, K, _ in layer_gemm_shapes(m, t, b) if name in LINEAR}
        elem += (e + 1) * sum(M * K for M, K in shapes.values())
        kernels += len(shapes)
    out["elem"] = elem / (gpu.hbm_bw * a.hbm_eff) + kernels * a.kernel_overhead_s
    return out


def layer_compute(m: TransformerShape, gpu: GpuType, t: int, b: int, a: Assumptions = DEFAULT,
                  sp: bool = False, cp: int = 1, fp8: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's compute on one TP rank, communication excluded.

    forward = the sum of :func:`layer_parts`; backward = 2 x forward GEMMs (data and weight
    gradients) + 2.5 x fused attention (FlashAttention-2 backward recomputes the scores) + 2 x
    elementwise traffic.
    """
    return compute_from_parts(layer_parts(m, gpu, t, b, a, sp, cp, fp8))


def compute_from_parts(parts: dict[str, float]) -> tuple[float, float]:
    """(forward, backward) seconds from :func:`layer_parts`."""
    gemm = sum(x for k, x in parts.items() if k not in ("attn", "elem"))
    return gemm + parts["attn"] + parts["elem"], 2 * gemm + 2.5 * parts["attn"] + 2 * parts["elem"]


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
    return tp_collective(nbytes, t, intra_bw, a)


def tp_collective(nbytes: float, t: int, intra_bw: float, a: Assumptions = DEFAULT) -> float:
    """One all-reduce of ``nbytes`` over the ``t`` ranks of a TP group inside a node, as a step pays it:
    the ring (:func:`ring_allreduce` at ``intra_bw * intra_eff``) plus ``a.tp_collective_at(t)``."""
    if t <= 1:
        return 0.0
    return ring_allreduce(nbytes, t, intra_bw * a.intra_eff, a.intra_latency_s) + a.tp_collective_at(t)


def layer_tp_comm(m: TransformerShape, t: int, b: int, intra_bw: float, a: Assumptions = DEFAULT,
                  overlap: dict[str, float] | None = None) -> tuple[float, float]:
    """(fwd, bwd) TP communication of one layer: 2 all-reduces forward (after attention and MLP,
    Megatron's g), 2 backward (before QKV and MLP-up, Megatron's f).

    ``overlap`` (the layer's forward GEMM times, :func:`layer_parts`): the communication runs
    under the GEMMs, as Megatron/Transformer Engine's TP overlap does with sequence parallelism:
    each all-reduce is an all-gather (of the input of the column-parallel GEMM after it: QKV,
    MLP-up) plus a reduce-scatter (of the output of the row-parallel GEMM before it: proj,
    MLP-down), each half the all-reduce's time, and each hidden behind its GEMM, so only
    ``max(half - GEMM, 0)`` is exposed. Backward, the same four halves hide behind the GEMMs'
    backward (data and weight gradients: twice the forward time).
    """
    x = tp_allreduce(m, t, b, intra_bw, a)
    if overlap is None or t == 1:
        return 2 * x, 2 * x
    half = x / 2
    return (sum(max(half - overlap[n], 0.0) for n in LINEAR),
            sum(max(half - 2 * overlap[n], 0.0) for n in LINEAR))


def cp_ring_exposed(m: TransformerShape, t: int, b: int, cp: int, attn_fwd: float, bw: float, latency: float) -> tuple[float, float]:
    """(fwd, bwd) seconds of ring attention's K/V traffic that attention compute does not hide.

    ``m`` is the per-rank shape (s/cp tokens). Forward: cp-1 steps, each passing a rank's K and V
    block, ``2*b*(s/cp)*k*d*e`` bytes, to the next rank on the cp ring while the current block's
    attention runs (Megatron-LM's context parallelism, "p2p" ring); backward passes K, V and
    their gradients (twice the bytes) under the attention backward (2.5 x forward).
    """
    if cp <= 1:
        return 0.0, 0.0
    kv = 2.0 * b * m.seq_len * m.kv_heads_per_rank(t) * m.head_dim * m.bytes_per_elem
    step = kv / bw + latency
    return max((cp - 1) * step - attn_fwd, 0.0), max(2 * (cp - 1) * step - 2.5 * attn_fwd, 0.0)


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
        return send_time(E / t, link_bw, a) + gather
    return send_time(E, link_bw, a)


def send_time(nbytes: float, link_bw: float, a: Assumptions = DEFAULT) -> float:
    """One blocking point-to-point send of ``nbytes`` over a link of ``link_bw`` (efficiency applied):
    ``nbytes/link_bw + p2p_latency``."""
    return nbytes / link_bw + a.p2p_latency_s


def ring_half(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring reduce-scatter or all-gather of ``nbytes`` (the full tensor) over ``n`` ranks:
    ``(n-1)/n * bytes / bw + (n-1) * latency``, half an all-reduce."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bw + (n - 1) * latency


def dp_allreduce(params_rank: float, dp: int, bw: float, latency: float, a: Assumptions = DEFAULT,
                 zero: int = 0, e: int = 2, gathered: float | None = None) -> float:
    """Once per iteration, the data-parallel synchronisation of one stage's TP shard over the dp
    ranks (ring, slowest link), by ZeRO stage (Rajbhandari et al. 2020, "ZeRO", Section 7.2,
    communication volumes with Psi parameters: data parallelism 2 Psi, stages 1-2 2 Psi, stage 3
    3 Psi, 1.5 x):

    - 0: all-reduce of the gradients, ``2(n-1)/n * P * g`` bytes per rank (g gradient bytes);
    - 1: reduce-scatter of the gradients (g bytes) + all-gather of the updated e-byte parameters
      (Megatron's distributed optimizer): ``(n-1)/n * P * (g + e)``, the same 2 Psi at g = e;
    - 2: the gradients were reduce-scattered micro-batch by micro-batch during the backward
      (:func:`zero_layer_comm`); left: the all-gather of the parameters, ``(n-1)/n * P * e``;
    - 3: nothing: the parameters stay sharded, gathered layer by layer when used.

    ``gathered``: the bytes the all-gather moves when not ``params_rank * e`` (fp8 layer weights
    are gathered in 1 byte, :func:`weight_gather_bytes`).

    Stage 1 without ``a.zero_shards_master`` is torch's ``ZeroRedundancyOptimizer`` over fp32
    masters: the whole gradient all-reduced, as without ZeRO, then each rank's updated fp32
    masters broadcast to the others, ``2(n-1)/n * P * g + (n-1)/n * P * 4``.
    """
    if zero == 0:
        return ring_allreduce(params_rank * a.grad_bytes, dp, bw, latency)
    if zero == 1 and not a.zero_shards_master:
        return ring_allreduce(params_rank * a.grad_bytes, dp, bw, latency) + ring_half(params_rank * 4, dp, bw, latency)
    ag = ring_half(params_rank * e if gathered is None else gathered, dp, bw, latency)
    if zero == 1:
        return ring_half(params_rank * a.grad_bytes, dp, bw, latency) + ag
    return ag if zero == 2 else 0.0


def zero_layer_comm(layer_params: float, dp: int, bw: float, latency: float, zero: int, a: Assumptions = DEFAULT,
                    e: int = 2) -> tuple[float, float]:
    """(fwd, bwd) ZeRO traffic of one layer per micro-batch (seconds), meant to run under that
    layer's compute (bucketed, prefetched), so callers charge only what outlasts it:

    - 2 (DeepSpeed ZeRO-2, FSDP SHARD_GRAD_OP): the layer's gradients are reduce-scattered as its
      backward produces them, ``(n-1)/n * P_layer * g``, so no rank holds the full gradient;
    - 3 (ZeRO-3, FSDP FULL_SHARD): the layer's parameters are all-gathered before its forward and
      again before its backward, ``(n-1)/n * P_layer * e`` each, plus the reduce-scatter: per
      micro-batch 3 Psi_layer (Rajbhandari et al. 2020, Section 7.2.2; Zhao et al. 2023,
      "PyTorch FSDP", Section 3: all-gather in forward and backward, reduce-scatter in backward).
    """
    if zero < 2:
        return 0.0, 0.0
    rs = ring_half(layer_params * a.grad_bytes, dp, bw, latency)
    if zero == 2:
        return 0.0, rs
    ag = ring_half(layer_params * e, dp, bw, latency)
    return ag, ag + rs


def weight_gather_bytes(fp8: bool, e: int, a: Assumptions = DEFAULT) -> int:
    """Bytes per layer weight that ZeRO gathers: 1 with fp8 weights (``a.fp8_params``), else e."""
    return 1 if fp8 and a.fp8_params else e


def zero3_copy_time(params: float, gpu: GpuType, a: Assumptions = DEFAULT, e_w: int = 2, e: int = 2) -> tuple[float, float]:
    """(fwd, bwd) seconds of ZeRO-3's copies on the compute stream for ``params`` parameters per
    micro-batch, as PyTorch FSDP2 (``fully_shard``, per-parameter sharding) runs them: after each
    all-gather its output is copied out into the parameters (``wait_for_unshard``'s copy-out: read
    and write ``e_w`` bytes a parameter, before the forward and again before the backward), and
    after the backward the gradients are copied, cast to the reduce dtype (g = ``a.grad_bytes``),
    into the reduce-scatter buffer (read e, write g). Memory-bound: ``bytes / (hbm_bw * hbm_eff)``.
    Nothing without ``a.zero3_copies`` (flat buffers whose views are the parameters)."""
    if not a.zero3_copies:
        return 0.0, 0.0
    bw = gpu.hbm_bw * a.hbm_eff
    out = 2.0 * e_w * params / bw
    return out, out + (e + a.grad_bytes) * params / bw


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


def optimizer_step(params_rank: float, gpu: GpuType, dp: int, zero: int, a: Assumptions = DEFAULT) -> float:
    """Mixed-precision Adam, memory-bound: ``P * optimizer_traffic_bytes / (hbm_bw * hbm_eff)``,
    P being the parameters this rank updates (its TP shard, divided by dp with ZeRO stage >= 1)."""
    n = params_rank / dp if zero else params_rank
    return n * a.optimizer_traffic_bytes / (gpu.hbm_bw * a.hbm_eff) + 10 * a.kernel_overhead_s


# ---------------------------------------------------------------- memory
def mlp_kept(m: TransformerShape, a: Assumptions = DEFAULT) -> int:
    """How many ffn-sized tensors one layer's MLP keeps for backward: 2 for GeLU or SiLU (its input,
    and its output as the down projection's input), 1 for ReLU (its backward needs only its output,
    the same tensor the down projection keeps), 3 gated (Megatron's fused SwiGLU keeps the gate and
    up halves and the product), 4 gated with ``a.unfused_llama`` (``silu(gate) * up`` as two ops:
    the product's backward keeps the SiLU output too, for the up half's gradient)."""
    if m.gated:
        return 4 if a.unfused_llama else 3
    return 1 if m.activation == "relu" else 2


def activation_bytes(m: TransformerShape, t: int, b: int, sp: bool = False, selective: bool = False,
                     fp8: bool = False, a: Assumptions = DEFAULT) -> float:
    """Activations one layer keeps for backward, per micro-batch, per TP rank (Korthikanti et al. 2022).

    GPT with dropout and standard attention gives ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``. In general:
    replicated ``e*M*4h`` (norm, QKV and MLP inputs) + ``2*M*h`` masks (dropout); sharded
    ``e*M*(2h/t + 2kd)`` (Q, K, V, attention output) + ``e*M*f/t`` x :func:`mlp_kept`;
    scores ``b*(a/t)*s^2*(2e+1)`` with dropout, ``e`` without, none with fused attention (it keeps
    a 4-byte log-sum-exp per row instead).

    ``a.unfused_llama`` (Llama as ``computron train`` runs it, each tensor read off what autograd
    saves in its layer, docs/planner.md): RoPE rotates Q and K out of place, so the fused attention
    keeps the rotated Q and K while its V, a view of the QKV projection's output, keeps that whole
    output alive, the unrotated Q and K included: ``e*M*(h/t + kd)`` more; the unfused SwiGLU keeps
    one ffn-sized tensor more (:func:`mlp_kept`); each RMSNorm keeps its float32 ``1/rms``, 4 bytes
    a token (replicated).

    Sequence parallelism (``sp``) shards the replicated part over the t ranks along the sequence;
    selective recomputation drops the scores (recomputed, :func:`attention_core_forward`). For GPT
    these give Korthikanti's ``sbh(34/t + 5as/(ht))``, ``sbh(10 + 24/t)`` and ``sbh * 34/t``.

    ``fp8``: Transformer Engine keeps the input of each weight GEMM as its fp8 cast, the one its
    weight-gradient GEMM reads (1 byte): the QKV and MLP-up inputs (h each, replicated unless
    ``sp``) and the MLP-down input (f/t) replace their 16-bit copies, which nothing else keeps.
    The attention output (h/t) is the exception: with fused attention its 16-bit copy stays kept
    (the fused backward reads O), so the output projection's fp8 copy adds 1 byte; with
    unfused attention nothing else keeps O and the fp8 copy replaces it.
    """
    e, s, h = m.bytes_per_elem, m.seq_len, m.hidden
    M = b * s
    kd = m.kv_heads_per_rank(t) * m.head_dim
    llama = a.unfused_llama and m.family == "llama"
    rep = (e * M * 4 * h + (2 * M * h if m.dropout else 0) + (2 * 4 * M if llama else 0)) / (t if sp else 1)
    sh = e * M * (2 * h / t + 2 * kd) + e * M * m.ffn / t * mlp_kept(m, a)
    if llama:
        sh += e * M * (h / t + kd)  # the unrotated Q and K, kept by V's view of the QKV output
    heads = b * m.heads / t
    if m.flash_attention:
        sc = 4 * heads * s
    elif selective:
        sc = 0.0
    else:
        sc = heads * s * s * ((2 * e + 1) if m.dropout else e)
    low = 0.0
    if fp8:
        out = -M * h / t if m.flash_attention else (e - 1) * M * h / t  # attention output, see above
        low = (e - 1) * M * (2 * h / (t if sp else 1) + m.ffn / t) + out
    return rep + sh + sc - low


def layer_input_bytes(m: TransformerShape, b: int, t: int = 1, sp: bool = False) -> float:
    """With full recomputation a layer keeps only its input, ``e*b*s*h`` (replicated over TP; with
    sequence parallelism each rank keeps s/t of it: divided by t)."""
    return m.bytes_per_elem * b * m.seq_len * m.hidden / (t if sp else 1)


def embedding_activation_bytes(m: TransformerShape, b: int, t: int = 1, sp: bool = False) -> float:
    """First stage, per micro-batch whose first chunk is in flight: the token ids (int64, 8 bytes
    a token) and, with dropout, the embedding dropout's 1-byte mask (``M*h``, divided by t with
    sequence parallelism, which scatters the embedding output before its dropout). The embedding
    output itself is the first layer's input, already counted in that layer's activations
    (Korthikanti et al. 2022, Section 4.3; Megatron-LM's theoretical memory estimate counts the
    same two terms)."""
    M = b * m.seq_len
    return 8.0 * M + (M * m.hidden / (t if sp else 1) if m.dropout else 0.0)


def head_activation_bytes(m: TransformerShape, t: int, b: int) -> float:
    """Last stage: logits (e bytes) and their fp32 copy for the loss, ``(e + 4) * M * V/t``."""
    return (m.bytes_per_elem + 4) * b * m.seq_len * m.vocab / t


def state_bytes(params_rank: float, dp: int, zero: int, a: Assumptions = DEFAULT, fp8: bool = False) -> float:
    """Weights, gradients and Adam state per rank: ``P * bytes_per_param`` = 2 (16-bit weights) +
    gradient bytes (2, 4 or 6) + 12 (fp32 master, m, v). ZeRO shards over the dp ranks the
    optimizer state (stage >= 1), then the gradients (>= 2), then the weights (3); the optimizer
    state's fp32 master too unless not ``a.zero_shards_master`` (then only the 8 moment bytes).

    ``fp8`` (only for the layers' weight-GEMM parameters; the embedding and head stay 16-bit):
    Transformer Engine's fp8 GEMMs on Hopper read the weight and its transpose in fp8, 1 byte
    each, kept between micro-batches. With ``a.fp8_params`` (fp8_param_gather) they replace the
    16-bit weight, so an unsharded weight still takes 2 bytes and a ZeRO-3 shard 1 (its fp8
    bytes; the transpose is made after the gather, :func:`zero_working_bytes`); without, they
    come on top: 2 more bytes per unsharded weight."""
    opt, w = 12.0, 2.0
    if fp8 and a.fp8_params and zero >= 3:
        w = 1.0
    g = a.bytes_per_param - opt - 2.0
    master = 0.0 if a.zero_shards_master else 4.0  # unsharded fp32 master (not a.zero_shards_master)
    per = (w / dp if zero >= 3 else w) + (g / dp if zero >= 2 else g) + \
        (master + (opt - master) / dp if zero >= 1 else opt)
    return params_rank * (per + (2.0 if fp8 and not a.fp8_params and zero < 3 else 0.0))


def zero_working_bytes(layer_params: float, fixed_params: float, zero: int, a: Assumptions = DEFAULT,
                       fp8: bool = False) -> float:
    """Full tensors ZeRO-2/3 hold for a moment: stage 2 one layer's gradient being reduced; stage
    3 also two layers' gathered weights (the one computing, the next prefetched: 16-bit, or with
    ``fp8`` the fp8 weight and its transpose, 2 bytes either way, 4 without ``a.fp8_params``) and,
    on the first and last stage, the gathered 16-bit embedding or head."""
    if zero < 2:
        return 0.0
    grad = layer_params * (a.bytes_per_param - 14)
    if zero == 2:
        return grad
    per = 2.0 + (2.0 if fp8 and not a.fp8_params else 0.0)
    return grad + 2 * layer_params * per + fixed_params * 2.0


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
