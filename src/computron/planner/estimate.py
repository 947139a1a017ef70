"""One plan's time, breakdown, memory and cost: the cost formulas composed per stage.

What flows through: a :class:`CostModel` (model + assumptions + optional measured profile), the
per-stage hardware views (layout.stage_envs) and a :class:`PlanConfig` (ParallelDims, micro-batch
size, virtual stages, recomputation, ZeRO stage, fp8, TP overlap) make a :class:`PlanContext`. It yields each stage's
per-layer op times, a memory-capped cost table for the partitioners, the per-chunk op durations
for the simulator and finally a :class:`PlanResult`.

Iteration time = max over stages of (pipeline finish + DP gradient all-reduce + tied-embedding
sync) + the slowest optimizer step (the global gradient-norm all-reduce synchronises all ranks).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from computron.parallel.dims import ParallelDims

from . import costs, partition, schedule
from .costs import DEFAULT, Assumptions
from .errors import PlannerError
from .hardware import GpuType, NodeType
from .layout import StageEnv
from .measured import ProfileTable
from .model import TransformerShape

if TYPE_CHECKING:
    import numpy as np

METHODS = ("balanced", "greedy", "exact")


@dataclass(frozen=True)
class PlanConfig:
    """The knobs of one plan besides placement and partition."""

    dims: ParallelDims
    mbs: int
    v: int = 1  # virtual stages (model chunks) per pipeline stage
    recompute: bool = False  # full activation recomputation
    # ZeRO stage over the dp*cp ranks: 1 optimizer state, 2 + gradients, 3 + weights (FSDP) sharded;
    # True (the former ``zero1`` flag) is stage 1
    zero: int = 0
    dp_overlap: bool = False  # gradient all-reduce overlapped with the last micro-batch's backward (torch DDP)
    sp: bool = False  # sequence parallelism (Korthikanti et al. 2022); only with tp > 1
    selective: bool = False  # selective recomputation of the attention core (when not recompute)
    fp8: bool = False  # the layers' weight GEMMs in fp8 (Transformer Engine), costs.layer_parts
    tp_overlap: bool = False  # TP communication under the GEMMs (needs sp), costs.layer_tp_comm

    def __post_init__(self) -> None:
        if int(self.zero) not in (0, 1, 2, 3) or isinstance(self.zero, float):
            raise PlannerError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero!r}")
        object.__setattr__(self, "zero", int(self.zero))
        if self.tp_overlap and self.dims.tp > 1 and not self.sp:
            raise PlannerError("TP communication overlap needs sequence parallelism (its all-gathers and "
                               "reduce-scatters are what run under the GEMMs)")

    @property
    def shard(self) -> int:
        """Ranks holding the same TP shard of a stage (gradient reduction and ZeRO sharding): dp*cp."""
        return self.dims.dp * self.dims.cp

    @property
    def recomputation(self) -> str:
        """"full", "selective" or "none"."""
        return "full" if self.recompute else "selective" if self.selective else "none"

    def micro_batches(self, m: TransformerShape) -> int:
        """m = global batch / (dp * mbs); raise when it does not divide or violates the schedule."""
        dp, pp = self.dims.dp, self.dims.pp
        if self.mbs < 1 or m.global_batch % (dp * self.mbs):
            raise PlannerError(f"global batch {m.global_batch} is not divisible by dp*mbs = {dp}*{self.mbs}")
        n = m.global_batch // (dp * self.mbs)
        if self.v > 1:
            if pp == 1:
                raise PlannerError("virtual stages (v>1) need pp>1")
            if n % pp:
                raise PlannerError(f"interleaved schedule needs micro-batches ({n}) divisible by pp={pp}")
            if m.layers < pp * self.v:
                raise PlannerError(f"{m.layers} layers cannot fill pp*v = {pp * self.v} chunks")
        return n


class CostModel:
    """Per-layer costs of one model, from the roofline or a measured profile, cached."""

    def __init__(self, model: TransformerShape, assumptions: Assumptions = DEFAULT, profile: ProfileTable | None = None):
        if profile is not None:
            profile.check_model(model)
        self.model, self.a, self.profile = model, assumptions, profile
        self._cache: dict = {}
        self.cache: dict = {}  # shared by PlanContexts: stage costs, memory caps, partitions

    def layer(self, gpu: GpuType, tp: int, mbs: int, sp: bool = False, selective: bool = False, cp: int = 1,
              fp8: bool = False, graphed: bool = False) -> tuple[float, float, float]:
        """(fwd s, bwd s, activation bytes) of one layer on one TP rank, communication excluded;
        ``sp``: sequence parallelism, ``selective``: the attention scores are not kept, ``cp``: the
        rank's s/cp of each sequence, ``fp8``: fp8 weight GEMMs. A profile measures the layer
        without sp or selective (the model's difference, elementwise traffic and kept bytes, is
        taken off the measured figures) and stands only for cp = 1 without fp8. ``graphed``: the
        layer runs in a CUDA graph (:meth:`paired`). A micro-batch size outside the profile's
        measured range is its nearest measured size's figures times the roofline's ratio of the two
        sizes, not the ratio of the sizes: a smaller micro-batch uses the GPU less well, a larger one
        better (on two H200s the roofline's ratios matched the profiles' graph replays within 3.5%,
        and picks at micro-batch 1 scaled in proportion ran 1.3-1.7x slower than predicted)."""
        sp = sp and tp > 1
        key = (gpu.name, tp, mbs, sp, selective, cp, fp8, graphed)
        hit = self._cache.get(key)
        profiled = hit is None and self.profile and self.profile.gpu == gpu.name and cp == 1 and not fp8
        edge = self.profile.nearest_size(tp, mbs) if profiled else mbs
        if edge != mbs:
            f, b, kept = self.layer(gpu, tp, edge, sp, selective, cp, fp8, graphed)
            k = sum(costs.compute_from_parts(self.parts(gpu, tp, mbs, sp, cp, fp8))) / sum(
                costs.compute_from_parts(self.parts(gpu, tp, edge, sp, cp, fp8)))
            hit = self._cache[key] = (f * k, b * k, kept * mbs / edge)
        if hit is None:
            m = self.model.context_shard(cp)
            act = costs.activation_bytes(m, tp, mbs, sp, selective, fp8, self.a)
            got = self.profile.lookup(gpu.name, tp, mbs) if self.profile and cp == 1 and not fp8 else None
            if got is not None:
                got = self.paired("layer", gpu, tp, mbs, got, graphed)
                saved = 0.0
                if sp:
                    saved = (costs.elementwise_bytes(m, tp, mbs) - costs.elementwise_bytes(m, tp, mbs, True)) / (
                        gpu.hbm_bw * self.a.hbm_eff)
                kept = act if got[2] is None else got[2] - (costs.activation_bytes(m, tp, mbs, a=self.a) - act)
                hit = (got[0] - saved, got[1] - 2 * saved, kept)
            else:
                hit = (*costs.compute_from_parts(self.parts(gpu, tp, mbs, sp, cp, fp8)), act)
            self._cache[key] = hit
        return hit

    def head(self, gpu: GpuType, tp: int, mbs: int, cp: int = 1) -> tuple[float, float]:
        """(fwd s, bwd s) of the last stage's final norm, logits and loss on one TP rank: measured
        where the profile has them (cp=1), else the roofline (``costs.head_compute``)."""
        got = self.profile.lookup_part("head", gpu.name, tp, mbs) if self.profile and cp == 1 else None
        return got if got is not None else costs.head_compute(self.model.context_shard(cp), gpu, tp, mbs, self.a)

    def parts(self, gpu: GpuType, tp: int, mbs: int, sp: bool = False, cp: int = 1, fp8: bool = False) -> dict:
        """The roofline's forward seconds of one layer's parts (costs.layer_parts), cached."""
        key = ("parts", gpu.name, tp, mbs, sp and tp > 1, cp, fp8)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = costs.layer_parts(self.model.context_shard(cp), gpu, tp, mbs, self.a,
                                                       sp and tp > 1, cp, fp8)
        return hit

    def ops(self, node: NodeType, tp: int, mbs: int, sp: bool, rec: str, cp: int = 1, fp8: bool = False,
            tp_overlap: bool = False, graphed: bool = False) -> tuple[float, float, float, float, float, float]:
        """One layer on one TP rank of ``node`` at micro-batch ``mbs``: (forward compute, backward
        compute, forward TP communication, backward TP communication, what recomputation ``rec``
        runs again, activation bytes kept). What depends on the placement (ZeRO and ring-attention
        traffic) is not here: PlanContext adds it; the search's bounds use this alone. ``graphed``: the
        micro-batch replays as a CUDA graph (``Assumptions.graphed_steps``; a pipeline's, stage by stage):
        the profile's graphed timings and the graphed per-collective cost (``Assumptions.graph_view``)."""
        key = ("ops", node.gpu.name, node.intra_bw, tp, mbs, sp, rec, cp, fp8, tp_overlap, graphed)
        hit = self._cache.get(key)
        if hit is None:
            m = self.model.context_shard(cp)
            f, bw, act = self.layer(node.gpu, tp, mbs, sp, rec == "selective", cp, fp8, graphed)
            over = self.parts(node.gpu, tp, mbs, sp, cp, fp8) if tp_overlap else None
            ftp, btp = costs.layer_tp_comm(m, tp, mbs, node.intra_bw, self.a.graph_view() if graphed else self.a, over)
            again = self.core(node.gpu, tp, mbs, cp) if rec == "selective" else 0.0
            if rec == "full":
                slower, again = self.recomputed(node.gpu, tp, mbs, cp, f, graphed)
                f, again = f + slower, again + ftp
            hit = self._cache[key] = (f, bw, ftp, btp, again, act)
        return hit

    def recomputed(self, gpu: GpuType, tp: int, mbs: int, cp: int, fwd: float,
                   graphed: bool = False) -> tuple[float, float]:
        """Seconds full recomputation adds to one layer's (forward, backward): measured where the
        profile has the layer recomputed (each less the plain layer's: the checkpointing's own work
        in the forward; the forward again and that work in the backward; both with ``paired_steps``
        from their ``step_s``, :meth:`paired`), else (0, ``fwd``)."""
        got = self.profile.lookup_part("recompute", gpu.name, tp, mbs) if self.profile and cp == 1 else None
        plain = self.profile.lookup(gpu.name, tp, mbs) if got is not None else None
        if plain is None:
            return 0.0, fwd
        got = self.paired("recompute", gpu, tp, mbs, got, graphed)
        plain = self.paired("layer", gpu, tp, mbs, plain, graphed)
        return max(got[0] - plain[0], 0.0), max(got[1] - plain[1], 0.0)

    def paired(self, part: str, gpu: GpuType, tp: int, mbs: int, got: tuple, graphed: bool = False) -> tuple:
        """``got`` (fwd s, bwd s, ...), a profile's figures of ``part`` (``layer``, ``recompute``), with
        ``graphed`` and the profile's ``graph_s`` of it, or else with ``Assumptions.paired_steps`` and its
        ``step_s``: that forward plus backward, split between the two in proportion to the separate
        timings; else ``got`` itself."""
        step = self.profile.lookup_step(part, gpu.name, tp, mbs, graphed=True) if graphed else None
        if step is None and self.a.paired_steps:
            step = self.profile.lookup_step(part, gpu.name, tp, mbs)
        total = got[0] + got[1]
        if step is None or total <= 0:
            return got
        return (step * got[0] / total, step * got[1] / total, *got[2:])

    def core(self, gpu: GpuType, tp: int, mbs: int, cp: int = 1) -> float:
        """Seconds selective recomputation adds to one layer's backward (costs.attention_core_forward)."""
        key = ("core", gpu.name, tp, mbs, cp)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = costs.attention_core_forward(self.model.context_shard(cp), gpu, tp, mbs, self.a)
        return hit

    def source(self, gpu: GpuType, tp: int, cp: int = 1, fp8: bool = False) -> str:
        p = self.profile
        measured = p and p.gpu == gpu.name and tp in p.entries and cp == 1 and not fp8
        return "profile" if measured else "roofline"


@dataclass(frozen=True)
class MemoryTerms:
    """What one stage's memory is made of (parameters in elements, activations in bytes)."""

    layer_params: float  # per layer, per TP rank
    fixed_params: float  # embedding (first stage), final norm + head (last stage)
    act_layer: float  # kept per layer per in-flight micro-batch
    act_work: float  # one layer's full activations while it is recomputed
    act_fixed_mb: float  # per micro-batch in flight in the first chunk (token ids, embedding dropout mask)
    act_fixed: float  # once (logits)
    out_mb: float = 0.0  # last stage of a pipeline: one micro-batch's output (its logits, e*M*V/t)
    pipelined: bool = False  # pp > 1 (the pipeline schedule's backward, not one autograd.grad per micro-batch)


def memory_terms(m: TransformerShape, tp: int, mbs: int, s: int, p: int, recompute: bool, act: float,
                 sp: bool = False, cp: int = 1) -> MemoryTerms:
    """The memory terms of stage s of p; ``act`` is one layer's activations per micro-batch (with
    the plan's sequence parallelism, selective recomputation and context parallelism already
    applied); the other activations are of the rank's s/cp tokens."""
    ml = m.context_shard(cp)
    fixed = act_mb = act_fixed = 0.0
    if s == 0:
        fixed += m.embedding_params(tp)
        act_mb = costs.embedding_activation_bytes(ml, mbs, tp, sp and tp > 1)
    out_mb = 0.0
    if s == p - 1:
        fixed += m.head_params(tp, p)
        act_fixed = costs.head_activation_bytes(ml, tp, mbs)
        out_mb = ml.bytes_per_elem * mbs * ml.seq_len * ml.vocab / tp if p > 1 else 0.0
    keep = costs.layer_input_bytes(ml, mbs, tp, sp and tp > 1) if recompute else act
    return MemoryTerms(m.layer_params(tp), fixed, keep, act if recompute else 0.0, act_mb, act_fixed, out_mb, p > 1)


def stage_memory(t: MemoryTerms, n: int, inflight: int, mb: int, v: int, dp: int, zero: int,
                 a: Assumptions, fp8: bool = False, first: int | None = None,
                 slots: tuple[int, int, int] | None = None) -> float:
    """Bytes per GPU of a stage holding n layers with ``inflight`` (chunk, micro-batch) activations:
    ``state_bytes(n*P_layer) + state_bytes(P_fixed) + ZeRO working set + inflight*ceil(n/v)*A_kept
    + A_work + first*A_first + A_fixed`` (``dp``: the ranks ZeRO shards over; ``first``: micro-batches
    in flight in the first chunk, :func:`schedule.first_chunk_inflight`, default ``min(inflight, mb)``;
    fp8 concerns the layers' weights only).

    The runtime's other peaks (the largest is the stage's), off by default (Megatron-LM's runtime):

    - ``a.keep_pipeline_outputs``: the last stage of a pipeline holds all ``mb`` micro-batches'
      logits ``O`` by its last backward (``+ mb*O`` above) and concatenates them after it, when no
      activations are left: ``states + 2*mb*O``;
    - ``a.step_transients`` (P the stage's parameters, G = P*grad_bytes its gradients): without a
      pipeline, the end of each micro-batch's backward holds its whole 16-bit gradient, ``states +
      2P``, and with one micro-batch no gradient is held while it runs (``- G`` above, the gradients
      being freed between steps); with dp > 1 the all-reduce copies every gradient into one flat
      buffer, ``states + G + mb*O``;
    - ``a.graphed_steps`` without a pipeline: the CUDA graphs' private pool keeps what one captured
      micro-batch allocates for the whole step, apart from the eager transients, at most its
      activations and its 16-bit gradient: ``states + A + 2P``, plus the flat copy ``G`` with dp > 1
      (an upper bound: the backward frees activations as the gradient grows);
    - ``a.graphed_steps`` with a pipeline, ``slots`` (:func:`schedule.graph_slots`: all the stage's
      chunks', its first chunk's, its last chunk's): each slot keeps a micro-batch's activations in
      its own pool, so the slots count as the micro-batches in flight (above the stage's in-flight peak
      when interleaved), and each keeps its chunk's 16-bit gradient, made before the addition into the
      float32 accumulators, and on the last stage the static logits and their gradient:
      ``+ 2*(slots*ceil(n/v)*P_layer + slots_c*P_fixed) + 2*slots_last*O`` (slots_c: the chunk
      holding the embedding or the head). On two H200s, held out on a second lease's run, the pipelines'
      peaks within -11% to +7%, their stages within 13% (bench/results/plan_accuracy_h200_x2_stage_graphs)."""
    params = n * t.layer_params + t.fixed_params
    states = costs.state_bytes(n * t.layer_params, dp, zero, a, fp8) + costs.state_bytes(t.fixed_params, dp, zero, a)
    states += costs.zero_working_bytes(t.layer_params, t.fixed_params, zero, a, fp8)
    graphed_stage = a.graphed_steps and t.pipelined and slots is not None
    if graphed_stage:
        inflight = slots[0]
    first = min(inflight, mb) if first is None else first
    act = inflight * math.ceil(n / v) * t.act_layer + t.act_work + first * t.act_fixed_mb + t.act_fixed
    graphed = a.graphed_steps and not t.pipelined
    if not (a.keep_pipeline_outputs or a.step_transients or graphed or graphed_stage):  # the search's hot path
        return states + act
    kept = mb * t.out_mb if a.keep_pipeline_outputs else 0.0
    peaks = [states + act + kept, states + 2 * kept]
    if graphed_stage:
        total, first_c, last_c = slots
        last = t.out_mb > 0
        pools = 2.0 * (total * math.ceil(n / v) * t.layer_params + (last_c if last else first_c) * t.fixed_params)
        peaks[0] += pools + 2.0 * last_c * t.out_mb
    if a.step_transients:
        grads = params * a.grad_bytes if zero < 2 else 0.0
        if not t.pipelined:
            peaks += [states + 2.0 * params]
            if mb == 1:
                peaks[0] -= grads
        if dp > 1:
            peaks += [states + grads + kept]
    if graphed:
        peaks += [states + act + 2.0 * params + (params * a.grad_bytes if dp > 1 and zero < 2 else 0.0)]
    return max(peaks)


def max_layers(t: MemoryTerms, usable: float, L: int, inflight: int, mb: int, v: int, dp: int, zero: int,
               a: Assumptions, fp8: bool = False, first: int | None = None,
               slots: tuple[int, int, int] | None = None) -> int:
    """Most layers (<= L) a stage can hold within ``usable`` bytes; 0 when not even one fits.
    Memory is (nearly, through ceil(n/v)) linear in n: start from the linear solution and step to
    the exact last n that fits (memory grows with n)."""
    def fits(n: int) -> bool:
        return stage_memory(t, n, inflight, mb, v, dp, zero, a, fp8, first, slots) <= usable

    slope = costs.state_bytes(t.layer_params, dp, zero, a, fp8) + inflight * t.act_layer / v
    room = usable - stage_memory(t, 0, inflight, mb, v, dp, zero, a, fp8, first, slots)
    n = min(L, max(0, math.floor(room / slope))) if slope > 0 else (L if room >= 0 else 0)
    while n < L and fits(n + 1):
        n += 1
    while n > 0 and not fits(n):
        n -= 1
    return n


@dataclass
class StageCost:
    """Per-micro-batch op times of one stage (seconds) and the terms of its memory (bytes)."""

    node: NodeType  # the slowest node type in the stage; its times are used
    lf: float  # one layer's forward op (compute + TP all-reduces + exposed ZeRO and ring traffic)
    lb: float  # one layer's backward op (+ recomputed forward)
    lf_tp: float
    lb_tp: float
    lb_rec: float
    l_zero: float  # per layer per micro-batch, forward + backward: exposed ZeRO-2/3 traffic
    l_cp: float  # ... exposed ring-attention traffic
    op_zero: float  # per chunk op (forward or backward): ZeRO-3's gather of its first layer, which
    # nothing before it hides (prefetching hides each next layer's behind the current one)
    ef: float  # embedding (first stage) and head (last stage) forward
    eb: float
    e_tp: float
    send_next: float  # p2p to stage s+1 (mod p)
    send_prev: float  # p2p to stage s-1 (mod p)
    mem: MemoryTerms
    usable: float
    capacity: float
    opt_gpu: GpuType


@dataclass
class PlanResult:
    """A costed plan. Times in seconds, memory in bytes, money in USD."""

    config: PlanConfig
    placement: tuple[str, ...]
    partition: tuple[int, ...]
    method: str
    micro_batches: int
    iteration_s: float
    breakdown: dict
    stage_gpus: list[str]
    stage_memory: list[float]
    stage_usable: list[float]
    stage_capacity: list[float]
    stage_time: list[float]  # forward + backward op time per micro-batch
    feasible: bool
    price_per_hour: float
    samples_per_s: float
    tokens_per_s: float
    cost_per_iteration: float
    usd_per_mtok: float
    model_tflops_per_gpu: float
    mfu: float
    sources: list[str] = field(default_factory=list)

    @property
    def dims(self) -> ParallelDims:
        return self.config.dims

    def key(self) -> tuple:
        c = self.config
        return (self.placement, c.dims, c.mbs, c.v, c.recompute, c.zero, c.dp_overlap, c.sp, c.selective, c.fp8,
                c.tp_overlap, self.partition)

    def to_dict(self) -> dict:
        d = asdict(self)
        c = self.config
        d["config"] = {"tp": self.dims.tp, "pp": self.dims.pp, "dp": self.dims.dp, "cp": self.dims.cp, "mbs": c.mbs,
                       "virtual_stages": c.v, "recompute": c.recompute, "zero": c.zero,
                       "dp_overlap": c.dp_overlap, "sequence_parallel": c.sp, "selective_recompute": c.selective,
                       "fp8": c.fp8, "tp_overlap": c.tp_overlap}
        return d


class PlanContext:
    """Everything about one (placement view, config) needed to partition, bound and simulate."""

    def __init__(self, cm: CostModel, envs: tuple[StageEnv, ...], cfg: PlanConfig):
        self.cm, self.envs, self.cfg = cm, envs, cfg
        self.m = cm.model
        self.p = cfg.dims.pp
        self.mb = cfg.micro_batches(self.m)
        if len(envs) != self.p:
            raise PlannerError(f"{len(envs)} stage views for pp={self.p}")
        p, cache = self.p, cm.cache
        self._keys = []
        self.stages = []
        for s in range(p):  # stages seeing the same hardware share their costs across contexts
            key = ("stage", envs[s], envs[(s + 1) % p], envs[(s - 1) % p], s == 0, s == p - 1, p > 1,
                   cfg.dims.tp, cfg.dims.cp, cfg.shard, cfg.mbs, cfg.recomputation, cfg.sp, cfg.zero, cfg.fp8,
                   cfg.tp_overlap)
            st = cache.get(key)
            if st is None:
                st = cache[key] = self._stage(s)
            self._keys.append(key)
            self.stages.append(st)
        self._caps: list[int] | None = None
        self._terms: tuple[list[float], list[float]] | None = None

    @property
    def caps(self) -> list[int]:
        """Most layers each stage can hold in memory (computed on first use, cached per stage view)."""
        if self._caps is None:
            cfg, cache = self.cfg, self.cm.cache
            caps = []
            for s, key in enumerate(self._keys):
                ck = ("cap", key, s, self.p, cfg.v, self.mb)
                k = cache.get(ck)
                if k is None:
                    k = cache[ck] = self._cap(s)
                caps.append(k)
            self._caps = caps
        return self._caps

    def fits(self) -> bool:
        """Whether any partition fits in memory (every stage holds >= v layers, together >= L)."""
        v, L = self.cfg.v, self.m.layers
        return all(k >= v for k in self.caps) and sum(min(k, L) for k in self.caps) >= L

    def quick_bound(self, cutoff: float = math.inf) -> float:
        """A partition-free lower bound on the pipeline time: :func:`partition.pipeline_min_max` over
        fractional partitions within the memory caps (every stage's m busy micro-batches, and the
        last stage's wait for the pipeline to fill and drain)."""
        t, c = self.linear_terms()
        k = 1.0 + self.straggle
        return k * partition.pipeline_min_max(self.m.layers, t, self.caps, self.mb, self.cfg.v, self.cfg.v, c,
                                             cutoff=cutoff / k)

    @property
    def straggle(self) -> float:
        """:func:`costs.straggler_factor` of this plan's dp (the slowest replica's extra fraction)."""
        return costs.straggler_factor(self.cfg.dims.dp, self.cm.a)

    # ---- per stage costs
    def _stage(self, s: int) -> StageCost:
        m, a, cfg, p = self.m, self.cm.a, self.cfg, self.p
        t, b, cp, n_sh, e = cfg.dims.tp, cfg.mbs, cfg.dims.cp, cfg.shard, m.bytes_per_elem
        ml = m.context_shard(cp)
        env = self.envs[s]
        best = None
        e_w = costs.weight_gather_bytes(cfg.fp8, e, a)  # fp8 weights are gathered in 1 byte
        zf, zb = costs.zero_layer_comm(m.layer_params(t), n_sh, env.dp_bw, env.dp_latency, cfg.zero, a, e_w)
        graphed = a.graphed_steps  # the runtime graphs every micro-batch (a pipeline's: each stage's)
        for node in env.nodes:
            f, bw, ftp, btp, rec, act = self.cm.ops(node, t, b, cfg.sp, cfg.recomputation, cp, cfg.fp8, cfg.tp_overlap,
                                                    graphed)
            attn = self.cm.parts(node.gpu, t, b, cfg.sp, cp, cfg.fp8)["attn"] if cp > 1 else 0.0
            cf, cb = costs.cp_ring_exposed(ml, t, b, cp, attn, env.cp_bw, env.cp_latency)
            xf, xb = max(zf - f, 0.0), max(zb - bw, 0.0)  # ZeRO traffic under the layer's compute
            if cfg.recompute:  # the forward run again pays its traffic again
                rec += xf + cf
            # ZeRO-3's copy-out of the gathered weights and copy-in of the gradients, on the compute stream
            kf, kb = costs.zero3_copy_time(m.layer_params(t), node.gpu, a, e_w, e) if cfg.zero == 3 else (0.0, 0.0)
            lf, lb = f + ftp + xf + cf + kf, bw + btp + xb + cb + rec + kb
            k = 2 if cfg.recompute else 1
            cand = (lf + lb, node, lf, lb, ftp, btp + (ftp if cfg.recompute else 0.0), rec, act, k * xf + xb + kf + kb,
                    k * cf + cb)
            if best is None or cand[0] > best[0]:
                best = cand
        _, node, lf, lb, ftp, btp, rec, act, l_zero, l_cp = best
        gpu = node.gpu
        ef = eb = e_tp = 0.0
        fixed = 0.0
        if graphed:
            a = a.graph_view()
        if s == 0:
            x, y = costs.embedding_compute(ml, gpu, t, b, a)
            tp_ar = costs.tp_allreduce(ml, t, b, node.intra_bw, a)
            ef, eb, e_tp = ef + x + tp_ar, eb + y, e_tp + tp_ar
            fixed += m.embedding_params(t)
        if s == p - 1:
            x, y = self.cm.head(gpu, t, b, cp)
            ce = 3 * costs.tp_collective(4.0 * b * ml.seq_len, t, node.intra_bw, a)
            ef, eb, e_tp = ef + x + ce, eb + y, e_tp + ce
            fixed += m.head_params(t, p)
        if fixed and cfg.zero >= 2:  # the embedding's and head's ZeRO traffic, under their compute
            gf, gb = costs.zero_layer_comm(fixed, n_sh, env.dp_bw, env.dp_latency, cfg.zero, a, e)
            kf, kb = costs.zero3_copy_time(fixed, gpu, a, e, e) if cfg.zero == 3 else (0.0, 0.0)
            ef, eb = ef + max(gf - ef, 0.0) + kf, eb + max(gb - eb, 0.0) + kb
        nxt, prv = self.envs[s], self.envs[(s - 1) % p]
        send_next = self._p2p(nxt, self.envs[(s + 1) % p]) if p > 1 else 0.0
        send_prev = self._p2p(prv, env) if p > 1 else 0.0
        usable = min(costs.usable_memory(n.gpu, a) for n in env.nodes)
        capacity = min(n.gpu.memory for n in env.nodes)
        opt_gpu = min((n.gpu for n in env.nodes), key=lambda g: g.hbm_bw)
        mem = memory_terms(m, t, b, s, p, cfg.recompute, act, cfg.sp, cp)
        first = zf if cfg.zero == 3 else 0.0
        return StageCost(node, lf, lb, ftp, btp, rec, l_zero, l_cp, first, ef, eb, e_tp, send_next, send_prev, mem, usable,
                         capacity, opt_gpu)

    def _p2p(self, src: StageEnv, dst: StageEnv) -> float:
        intra = min(n.intra_bw for n in dst.nodes)
        return costs.p2p_time(self.m.context_shard(self.cfg.dims.cp), self.cfg.dims.tp, self.cfg.mbs, src.next_bw,
                              intra, self.cm.a, src.next_crosses)

    # ---- memory
    def memory(self, s: int, n: int) -> float:
        """Bytes per GPU of stage s holding n layers: states + in-flight activations (+ fixed parts)."""
        cfg = self.cfg
        inflight = schedule.inflight_closed_form(self.p, cfg.v, self.mb, s)
        return stage_memory(self.stages[s].mem, n, inflight, self.mb, cfg.v, cfg.shard, cfg.zero, self.cm.a, cfg.fp8,
                            schedule.first_chunk_inflight(self.p, cfg.v, self.mb), self._slots(s))

    def _slots(self, s: int) -> tuple[int, int, int] | None:
        """Stage s's graph slots when the runtime graphs a pipeline's stages (``stage_memory``)."""
        if not (self.cm.a.graphed_steps and self.p > 1):
            return None
        return schedule.graph_slots(self.p, self.cfg.v, self.mb, s)

    def _cap(self, s: int) -> int:
        """Most layers stage s can hold within its usable memory (0 when even one does not fit)."""
        cfg = self.cfg
        inflight = schedule.inflight_closed_form(self.p, cfg.v, self.mb, s)
        first = schedule.first_chunk_inflight(self.p, cfg.v, self.mb)
        return max_layers(self.stages[s].mem, self.stages[s].usable, self.m.layers, inflight, self.mb, cfg.v,
                          cfg.shard, cfg.zero, self.cm.a, cfg.fp8, first, self._slots(s))

    # ---- partitioning
    def linear_terms(self) -> tuple[list[float], list[float]]:
        """Per stage: time per layer (F+B) and fixed time per micro-batch (extras + sends)."""
        if self._terms is None:
            self._terms = self._linear_terms()
        return self._terms

    def _linear_terms(self) -> tuple[list[float], list[float]]:
        v, p = self.cfg.v, self.p
        t, c = [], []
        for s, st in enumerate(self.stages):
            sends = 0.0
            if p > 1:
                n_next = v - (1 if s == p - 1 else 0)
                n_prev = v - (1 if s == 0 else 0)
                sends = n_next * st.send_next + n_prev * st.send_prev
            t.append(st.lf + st.lb)
            c.append(st.ef + st.eb + sends + 2 * v * st.op_zero + (2 * v * self.cm.a.chunk_overhead_s if p > 1 else 0.0))
        return t, c

    def cost_table(self, respect_memory: bool = True) -> np.ndarray:
        t, c = self.linear_terms()
        caps = self.caps if respect_memory else [self.m.layers] * self.p
        caps = [k if k >= self.cfg.v else 0 for k in caps]
        table = partition.linear_costs(self.m.layers, t, c, caps)
        if self.cfg.v > 1:
            table[:, : self.cfg.v] = math.inf
        return table

    def partition(self, method: str, respect_memory: bool = True) -> tuple[int, ...] | None:
        """Layer counts by ``method`` (balanced, greedy or exact); None when nothing fits
        (``respect_memory=False`` ignores the memory caps, for reporting an infeasible plan)."""
        L, v = self.m.layers, self.cfg.v
        caps = self.caps if respect_memory else [L] * self.p
        t, c = self.linear_terms()
        key = ("partition", method, tuple(t), tuple(c), tuple(caps), L, v)
        if key not in self.cm.cache:
            self.cm.cache[key] = self._partition(method, caps, respect_memory)
        return self.cm.cache[key]

    def _partition(self, method: str, caps: list[int], respect_memory: bool) -> tuple[int, ...] | None:
        L, v = self.m.layers, self.cfg.v
        if method == "balanced":
            counts = partition.balanced(L, self.p)
        elif method == "greedy":
            t, c = self.linear_terms()
            counts = partition.greedy(L, t, c, caps)
        elif method == "exact":
            counts = partition.exact(self.cost_table(respect_memory))
        else:
            raise PlannerError(f"unknown partition method {method!r} ({', '.join(METHODS)} or explicit counts)")
        if counts is None or any(k < v or k > cap for k, cap in zip(counts, caps)):
            return None
        return counts

    def check_counts(self, counts) -> tuple[int, ...]:
        counts = tuple(int(k) for k in counts)
        if len(counts) != self.p or sum(counts) != self.m.layers or min(counts) < self.cfg.v:
            raise PlannerError(f"partition {list(counts)} must have pp={self.p} entries of at least "
                               f"{self.cfg.v} layer(s) summing to {self.m.layers}")
        return counts

    # ---- schedule
    def durations(self, counts) -> tuple[list[float], list[float]]:
        """Forward and backward op time of each global chunk (chunk j*p+s on stage s); with pp > 1
        every chunk op also pays ``chunk_overhead_s`` (see costs.Assumptions)."""
        p, v = self.p, self.cfg.v
        C = p * v
        ov = self.cm.a.chunk_overhead_s if p > 1 else 0.0
        fwd, bwd = [0.0] * C, [0.0] * C
        for s, st in enumerate(self.stages):
            q, r = divmod(counts[s], v)
            for j in range(v):
                c = j * p + s
                n = q + (1 if j < r else 0)
                fwd[c] = n * st.lf + (st.send_next if c < C - 1 else 0.0) + ov + st.op_zero
                bwd[c] = n * st.lb + (st.send_prev if c > 0 else 0.0) + ov + st.op_zero
        s0, sl = self.stages[0], self.stages[-1]
        fwd[0] += s0.ef if p > 1 else 0.0
        bwd[0] += s0.eb if p > 1 else 0.0
        fwd[C - 1] += sl.ef
        bwd[C - 1] += sl.eb
        return fwd, bwd

    def tails(self, counts) -> tuple[list[float], list[float], list[float]]:
        """Per stage: DP gradient synchronisation (costs.dp_allreduce by ZeRO stage), tied-embedding
        sync, optimizer step (seconds). With ``dp_overlap`` the synchronisation runs during the last
        micro-batch's backward on the stage (torch DDP's buckets): only what outlasts that backward
        is exposed."""
        cfg, m, a = self.cfg, self.m, self.cm.a
        dp_t, emb_t, opt_t = [], [], []
        sync = 0.0
        if m.tie_embeddings and self.p > 1:
            e0 = self.envs[0]
            sync = costs.embedding_sync(m, cfg.dims.tp, e0.emb_bw, e0.emb_latency, a)
        for s, st in enumerate(self.stages):
            params = counts[s] * st.mem.layer_params + st.mem.fixed_params
            env = self.envs[s]
            e = m.bytes_per_elem  # the weights' all-gather: fp8 layer weights in 1 byte
            gathered = counts[s] * st.mem.layer_params * costs.weight_gather_bytes(cfg.fp8, e, a) + st.mem.fixed_params * e
            ar = costs.dp_allreduce(params, cfg.shard, env.dp_bw, env.dp_latency, a, cfg.zero, e, gathered)
            if cfg.dp_overlap:
                ar = max(ar - counts[s] * st.lb, 0.0)
            dp_t.append(ar)
            emb_t.append(sync if s in (0, self.p - 1) else 0.0)
            opt_t.append(costs.optimizer_step(params, st.opt_gpu, cfg.shard, cfg.zero, a))
        return dp_t, emb_t, opt_t

    def lower_bound(self, counts) -> float:
        """A time no simulation of this partition can beat (for branch and bound)."""
        fwd, bwd = self.durations(counts)
        dp_t, emb_t, opt_t = self.tails(counts)
        pipe = schedule.lower_bound(self.p, self.cfg.v, self.mb, fwd, bwd) * (1.0 + self.straggle)
        return pipe + dp_t[0] + emb_t[0] + max(opt_t)

    def result(self, counts, method: str, placement: tuple[NodeType, ...]) -> PlanResult:
        """Simulate the schedule and assemble the plan's time, breakdown, memory and cost."""
        m, cfg, p, mb = self.m, self.cfg, self.p, self.mb
        fwd, bwd = self.durations(counts)
        tl = schedule.simulate(p, cfg.v, mb, fwd, bwd)
        dp_t, emb_t, opt_t = self.tails(counts)
        wait = [tl.finish[s] * self.straggle for s in range(p)]  # the slowest of dp replicas
        ends = [tl.finish[s] + wait[s] + dp_t[s] + emb_t[s] for s in range(p)]
        crit = max(range(p), key=lambda s: ends[s])
        total = ends[crit] + max(opt_t)
        st = self.stages[crit]
        n = counts[crit]
        sends = 0.0
        if p > 1:
            sends = sum(f for c, f in enumerate(fwd) if c % p == crit) + sum(b for c, b in enumerate(bwd) if c % p == crit)
            sends -= n * (st.lf + st.lb)
            sends -= (st.ef + st.eb) if crit in (0, p - 1) else 0.0
            sends -= 2 * cfg.v * st.op_zero
        has_extra = crit == p - 1 or (crit == 0 and p > 1)
        tp_part = mb * (n * (st.lf_tp + st.lb_tp) + (st.e_tp if has_extra else 0.0))
        pp_part = mb * max(sends, 0.0)
        zero_part, cp_part = mb * (n * st.l_zero + 2 * cfg.v * st.op_zero), mb * n * st.l_cp
        compute = tl.busy[crit] - tp_part - pp_part - zero_part - cp_part
        breakdown = {"compute": compute, "bubble": max(tl.finish[crit] - tl.busy[crit], 0.0), "tp": tp_part, "pp": pp_part,
                     "dp": dp_t[crit] + wait[crit] + zero_part, "cp": cp_part, "other": emb_t[crit] + max(opt_t),
                     "recompute": mb * n * st.lb_rec}
        mem = [self.memory(s, counts[s]) for s in range(p)]
        price = sum(nd.price for nd in placement)
        tokens = m.global_batch * m.seq_len
        gpus = sum(nd.gpus_per_node for nd in placement)
        peak = sum(nd.gpus_per_node * nd.gpu.peak_flops(m.dtype) for nd in placement)
        flops = costs.model_flops_per_iteration(m)
        return PlanResult(
            config=cfg, placement=tuple(nd.name for nd in placement), partition=tuple(counts), method=method,
            micro_batches=mb, iteration_s=total, breakdown=breakdown,
            stage_gpus=[e.gpu_names for e in self.envs], stage_memory=mem,
            stage_usable=[x.usable for x in self.stages], stage_capacity=[x.capacity for x in self.stages],
            stage_time=[counts[s] * (x.lf + x.lb) for s, x in enumerate(self.stages)],
            feasible=all(mm <= x.usable for mm, x in zip(mem, self.stages)),
            price_per_hour=price, samples_per_s=m.global_batch / total, tokens_per_s=tokens / total,
            cost_per_iteration=price * total / 3600, usd_per_mtok=price / 3600 / (tokens / total) * 1e6,
            model_tflops_per_gpu=flops / total / gpus / 1e12, mfu=flops / total / peak,
            sources=sorted({self.cm.source(n.gpu, cfg.dims.tp, cfg.dims.cp, cfg.fp8) for e in self.envs for n in e.nodes}))
