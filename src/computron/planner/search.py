"""Search over node subsets, placements, (tp, cp, pp, dp), micro-batch size, virtual stages,
ZeRO stage, recomputation and layer partitions; exact branch and bound on the simulated time.

What flows through: a model, a cluster, :class:`SearchOptions` and a CostModel go in; a
:class:`SearchResult` with the best ``top`` feasible plans (ranked by the objective) comes out.

Enumeration: for each node composition (every sub-multiset of the available nodes, or all of
them with ``all_nodes``), each tp dividing the GPUs of every node type (and the heads), each cp
(:func:`cp_degrees`: only for long sequences), each pp <= layers with dp = GPUs/(tp*cp*pp)
dividing the global batch, each distinct ordering of the nodes (placements whose stages see
identical hardware are merged), each micro-batch size dividing the per-replica batch, each v, a
memory rung (:func:`_rungs`: a higher ZeRO stage, then selective, then full recomputation) only
when the plan does not fit with the one before, and each partition method (beyond ``max_orderings`` orderings per
composition, nodes of a type move in blocks). The space is walked best-first by lower bounds
that tighten level by level (see :func:`search`); nothing whose bound cannot beat the current
top-K is built or simulated, so the returned plans are the exact optimum of the simulated cost
model.

Objectives: ``time`` (least iteration time), ``cost`` (least USD per iteration, with an optional
``time_limit`` per iteration), ``throughput`` (most samples/s with ``cost_limit`` USD/hour).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from functools import reduce

from computron.parallel.dims import ParallelDims

from . import costs
from .errors import PlannerError
from . import schedule
from .estimate import METHODS, CostModel, PlanConfig, PlanContext, PlanResult, max_layers, memory_terms
from .hardware import Cluster
from .partition import pipeline_min_max
from .layout import check_dims, compositions, distinct_orderings, stage_envs, stage_node_names
from .model import TransformerShape

OBJECTIVES = ("time", "cost", "throughput")
# Recomputation, least first: each keeps less activation memory and is no faster in the cost model
# (selective runs the attention core's forward again, full the whole layer's).
RUNGS = ("none", "selective", "full")
# ZeRO stages, least sharding first: stage 1 is never slower than 0 in the cost model (the same
# traffic, a dp-th of the optimizer step), 2 and 3 hold less and add traffic; the default tries
# 1, 2, 3 in turn (as rungs, before recomputation: the first with which a configuration fits)
ZERO_AUTO = (1, 2, 3)
CP_MIN_TOKENS = 4096  # context parallelism is searched only while each rank keeps this many tokens
DIVE = 1e18  # subtracted from the heap key of entries explored ahead of their bound


@dataclass(frozen=True)
class SearchOptions:
    """What to search and how to rank; ``None`` in tp/pp/mbs means every valid value."""

    objective: str = "time"
    top: int = 10
    time_limit: float | None = None  # seconds per iteration (objective "cost")
    cost_limit: float | None = None  # USD per hour of the nodes used (objective "throughput")
    methods: tuple[str, ...] = METHODS
    virtual_stages: tuple[int, ...] = (1,)  # model chunks per stage to try (interleaved 1F1B when > 1)
    # auto: the first of none, selective, full with which a configuration fits (selective is
    # skipped with fused attention, where it keeps and costs what none does); or only that one
    recompute: str = "auto"
    # Plans with tp > 1 use sequence parallelism: in the cost model it is never slower (the same
    # bytes as reduce-scatter + all-gather instead of all-reduce, a tp-th of the norms' and
    # dropouts' work and activations) and holds less.
    sequence_parallel: bool = True
    all_nodes: bool = False  # only plans that use every available node
    max_mbs: int = 64
    max_orderings: int = 20000  # per composition; beyond it nodes of a type move in blocks
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    mbs: tuple[int, ...] | None = None
    zero: tuple[int, ...] | None = None  # ZeRO stages to try in turn (None: ZERO_AUTO); (1,): the former zero1
    cp: tuple[int, ...] | None = None  # context-parallel degrees (None: cp_degrees' rule)
    fp8: bool = False  # fp8 weight GEMMs (only compositions whose GPUs all have fp8)
    tp_overlap: bool = False  # plans with sequence parallelism overlap TP communication with the GEMMs

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise PlannerError(f"unknown objective {self.objective!r} ({', '.join(OBJECTIVES)})")
        if self.recompute not in ("auto", *RUNGS):
            raise PlannerError(f"recompute must be auto, none, selective or full, got {self.recompute!r}")
        bad = [x for x in self.methods if x not in METHODS]
        if bad:
            raise PlannerError(f"unknown partition method(s) {bad} ({', '.join(METHODS)})")
        if self.max_orderings < 1:
            raise PlannerError("max_orderings must be at least 1")
        if self.top < 1:
            raise PlannerError("top must be at least 1")
        if self.objective == "throughput" and self.cost_limit is None:
            raise PlannerError("objective 'throughput' needs a cost limit (USD per hour)")
        if self.zero is not None and (not self.zero or any(z not in (0, 1, 2, 3) for z in self.zero)):
            raise PlannerError(f"ZeRO stages must be among 0, 1, 2, 3, got {self.zero}")


@dataclass
class SearchResult:
    plans: list[PlanResult]
    stats: dict = field(default_factory=dict)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def objective_value(opts: SearchOptions, time_s: float, price: float) -> float:
    """The quantity ranked (smaller is better): seconds, or USD per iteration for ``cost``."""
    return time_s * price / 3600 if opts.objective == "cost" else time_s


def _recompute_options(m: TransformerShape, opts: SearchOptions) -> tuple[str, ...]:
    """The recomputation rungs a configuration tries, in order (it takes the first that fits)."""
    if opts.recompute != "auto":
        return (opts.recompute,)
    return ("none", "full") if m.flash_attention else RUNGS


def _rungs(m: TransformerShape, opts: SearchOptions, dims: ParallelDims) -> tuple[tuple[int, str], ...]:
    """The memory rungs (ZeRO stage, recomputation) a configuration tries, in order, taking the
    first with which it fits: every ZeRO stage with no recomputation, then with the next
    recomputation, and so on. With one rank per TP shard (dp*cp = 1) ZeRO shards nothing: stage 0."""
    zeros = (0,) if dims.dp * dims.cp == 1 else (opts.zero or ZERO_AUTO)
    return tuple((z, rec) for rec in _recompute_options(m, opts) for z in zeros)


def cp_degrees(m: TransformerShape, opts: SearchOptions) -> tuple[int, ...]:
    """Context-parallel degrees to try: ``opts.cp``, else 1 and, for a model with fused attention,
    every power of two cp with s divisible by 2*cp (two load-balanced causal chunks per rank)
    and at least ``CP_MIN_TOKENS`` tokens of each sequence per rank (so cp=2 from 8K tokens: below
    that the ring's traffic outgrows the attention it hides behind and TP or PP split better)."""
    if opts.cp:
        return opts.cp
    out, c = [1], 2
    while m.flash_attention and m.seq_len % (2 * c) == 0 and m.seq_len // c >= CP_MIN_TOKENS:
        out.append(c)
        c *= 2
    return tuple(out)


def _config(dims: ParallelDims, b: int, v: int, rung: tuple[int, str], opts: SearchOptions, sp: bool) -> PlanConfig:
    zero, rec = rung
    return PlanConfig(dims, b, v, rec == "full", zero, sp=sp, selective=rec == "selective", fp8=opts.fp8,
                      tp_overlap=opts.tp_overlap and sp)


def _layouts(m: TransformerShape, n_gpus: int, per_node: list[int], opts: SearchOptions):
    """Valid ParallelDims for n_gpus GPUs on nodes of the given sizes."""
    g = reduce(math.gcd, per_node)
    for tp in divisors(g):
        if opts.tp and tp not in opts.tp:
            continue
        for cp in cp_degrees(m, opts):
            if (n_gpus // tp) % cp:
                continue
            for pp in divisors(n_gpus // (tp * cp)):
                if pp > m.layers or (opts.pp and pp not in opts.pp):
                    continue
                dp = n_gpus // (tp * cp * pp)
                if m.global_batch % dp:
                    continue
                dims = ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp)
                try:
                    check_dims(m, dims, per_node)
                except PlannerError:
                    continue
                yield dims


def _tau(m: TransformerShape, nt, dims: ParallelDims, b: int, cm: CostModel, opts: SearchOptions,
         rec: str = "none") -> float:
    """Seconds one group of tp*cp GPUs of node type ``nt`` spends per layer per sample at
    micro-batch ``b`` (forward + backward op, TP communication included, plus what recomputation
    ``rec`` runs again: the forward with "full", the attention core's with "selective";
    :meth:`CostModel.ops`). Never above a plan's time (which adds ZeRO and ring traffic that
    compute does not hide) nor below the time with less recomputation, so the bounds hold."""
    sp = _sp(opts, dims)
    key = ("tau", id(nt), dims.tp, dims.cp, b, rec, sp, opts.fp8, opts.tp_overlap)
    tau = cm.cache.get(key)
    if tau is None:
        f, bw, ftp, btp, again, _ = cm.ops(nt, dims.tp, b, sp, rec, dims.cp, opts.fp8, opts.tp_overlap and sp,
                                           cm.a.graphed_steps)
        tau = cm.cache[key] = (f + bw + ftp + btp + again) / b
    return tau


class _StageTables:
    """Per group (tp/pp/dp fixed): upper bounds on the layers a stage on a given set of node types
    can hold at each stage index, and its per-layer time, computed once per set."""

    def __init__(self, m: TransformerShape, dims: ParallelDims, opts: SearchOptions, cm: CostModel):
        self.m, self.dims, self.opts, self.cm = m, dims, opts, cm
        self.sp = _sp(opts, dims)
        self.rungs = _rungs(m, opts, dims)
        self.sets: list[tuple] = []  # node-type tuples, by set id
        self._ids: dict = {}
        self._caps: dict = {}
        self._w: dict = {}

    def set_id(self, names: tuple[str, ...], nodes: tuple) -> int:
        k = self._ids.get(names)
        if k is None:
            k = self._ids[names] = len(self.sets)
            self.sets.append(nodes)
        return k

    def caps(self, k: int, b: int, v: int, rung: tuple[int, str]) -> list[int]:
        """Per stage index: at most this many layers fit on node set k with memory rung ``rung``
        (its least memory and least activation size, so never below what PlanContext finds for
        any placement)."""
        key = (k, b, v, rung)
        got = self._caps.get(key)
        if got is None:
            m, dims, cm, nodes, opts = self.m, self.dims, self.cm, self.sets[k], self.opts
            zero, rec = rung
            mb = m.global_batch // (dims.dp * b)
            act = min(cm.layer(n.gpu, dims.tp, b, self.sp, rec == "selective", dims.cp, opts.fp8)[2] for n in nodes)
            usable = min(costs.usable_memory(n.gpu, cm.a) for n in nodes)
            got = []
            for s in range(dims.pp):
                terms = memory_terms(m, dims.tp, b, s, dims.pp, rec == "full", act, self.sp, dims.cp)
                inflight = schedule.inflight_closed_form(dims.pp, v, mb, s)
                got.append(max_layers(terms, usable, m.layers, inflight, mb, v, dims.dp * dims.cp, zero, cm.a,
                                      opts.fp8, schedule.first_chunk_inflight(dims.pp, v, mb)))
            self._caps[key] = got
        return got

    def fixed(self, sig: tuple[int, ...], b: int, v: int) -> list[float]:
        """Per stage, a lower bound on its time per micro-batch besides its layers: the embedding on
        the first stage, the head on the last (at their fastest type) and the pipeline sends (over
        the network at the fastest link when a stage's G GPUs fill whole nodes on both sides, else
        at the fastest intra-node link), and the per-chunk overhead of its 2v chunk ops."""
        p = self.dims.pp
        out = [0.0] * p
        if p == 1:
            out[0] = self._part("head", sig[0], b)
            return out
        for s in range(p):
            out[s] = (v - (s == p - 1)) * self._part("send", (sig[s], sig[(s + 1) % p]), b) + \
                (v - (s == 0)) * self._part("send", (sig[s], sig[(s - 1) % p]), b) + 2 * v * self.cm.a.chunk_overhead_s
        out[0] += self._part("emb", sig[0], b)
        out[-1] += self._part("head", sig[-1], b)
        return out

    def _part(self, kind: str, k, b: int) -> float:
        key = (kind, k, b)
        got = self._w.get(key)
        if got is None:
            m, a, t, G = self.m.context_shard(self.dims.cp), self.cm.a, self.dims.tp, self.dims.world_size // self.dims.pp
            if kind == "emb":
                got = min(sum(costs.embedding_compute(m, n.gpu, t, b, a)) for n in self.sets[k])
            elif kind == "head":
                got = min(sum(costs.head_compute(m, n.gpu, t, b, a)) for n in self.sets[k])
            else:
                here, other = self.sets[k[0]], self.sets[k[1]]
                both = here + other
                crosses = G >= max(n.gpus_per_node for n in both)
                bw = (min(n.nic_per_gpu for n in both) * a.inter_eff if crosses
                      else max(n.intra_bw for n in both) * a.intra_eff)
                got = costs.p2p_time(m, t, b, bw, max(n.intra_bw for n in other), a, crosses)
            self._w[key] = got
        return got

    def w(self, k: int, b: int, rung: tuple[int, str]) -> float:
        """Seconds per layer per micro-batch on node set k (its slowest type) with memory rung ``rung``
        (a lower bound: the ZeRO stage's traffic left out)."""
        key = (k, b, rung[1])
        got = self._w.get(key)
        if got is None:
            got = self._w[key] = b * max(_tau(self.m, n, self.dims, b, self.cm, self.opts, rung[1]) for n in self.sets[k])
        return got


def _sp(opts: SearchOptions, dims: ParallelDims) -> bool:
    """Whether the plans of this layout use sequence parallelism."""
    return opts.sequence_parallel and dims.tp > 1


def _free_bound(m: TransformerShape, dims: ParallelDims, stage_nodes, b: int, cm: CostModel, opts: SearchOptions) -> float:
    """A bound for plans whose stages fall on these node types (in any order) at micro-batch b,
    memory ignored: a stage runs at its slowest type's ``tau_s``; one replica's B/dp samples
    through L layers take at least ``(B/dp) * L / sum_s 1/tau_s``."""
    rate = sum(1.0 / max(_tau(m, n, dims, b, cm, opts) for n in nodes) for nodes in stage_nodes)
    return m.global_batch / dims.dp * m.layers / rate * _slowest(dims, cm)


def _slowest(dims: ParallelDims, cm: CostModel) -> float:
    """Every pipeline time is multiplied by this (the wait for the slowest of dp replicas,
    :func:`costs.straggler_factor`), so bounds on it may be too."""
    return 1.0 + costs.straggler_factor(dims.dp, cm.a)


def _recompute_choice(m: TransformerShape, sig: tuple[int, ...], b: int, v: int, opts: SearchOptions,
                      tabs: _StageTables) -> tuple[int, str] | None:
    """The ZeRO stage and recomputation of plans whose stage s falls on node set ``sig[s]``
    (micro-batch b, v chunks): the first of :func:`_rungs` whose memory caps allow the layers on
    every stage; None when nothing fits (or v does not divide the schedule)."""
    dims = tabs.dims
    mb = m.global_batch // (dims.dp * b)
    if v > 1 and (dims.pp == 1 or mb % dims.pp or m.layers < dims.pp * v):
        return None
    for rung in tabs.rungs:
        lists = {k: tabs.caps(k, b, v, rung) for k in set(sig)}
        caps = [lists[k][s] for s, k in enumerate(sig)]
        if min(caps) >= v and sum(caps) >= m.layers:
            return rung
    return None


def _shared_recompute_choice(m: TransformerShape, sig: tuple[int, ...], b: int, v: int, opts: SearchOptions,
                             tabs: _StageTables) -> tuple[int, str] | None:
    """The first memory rung when every ordering of the stages on node sets ``sig`` fits
    with it (each set at its least memory cap over the positions), so all make the same
    :func:`_recompute_choice`; None when orderings must be decided one by one."""
    dims = tabs.dims
    if v > 1 and (dims.pp == 1 or m.global_batch // (dims.dp * b) % dims.pp or m.layers < dims.pp * v):
        return None
    rung = tabs.rungs[0]
    return rung if _fits_every_order(m, sig, v, {k: tabs.caps(k, b, v, rung) for k in set(sig)}) else None


def _fits_every_order(m: TransformerShape, sig: tuple[int, ...], v: int, lists: dict) -> bool:
    """Whether every ordering of the stages on node sets ``sig`` fits with these per-position
    memory caps (each set at its least over the positions)."""
    caps = [min(lists[k]) for k in sig]
    return min(caps) >= v and sum(caps) >= m.layers


def _fill_bound(m: TransformerShape, sig: tuple[int, ...], b: int, v: int, rec: tuple[int, str], tabs: _StageTables,
                cutoff: float = math.inf, rel_tol: float = 1e-3) -> float:
    """:func:`pipeline_min_max` for plans whose stage s falls on node set ``sig[s]`` (micro-batch b,
    v chunks, recomputation ``rec``): the capped bound plus the pipeline's fill and drain."""
    mb = m.global_batch // (tabs.dims.dp * b)
    lists = {k: tabs.caps(k, b, v, rec) for k in set(sig)}
    caps = [lists[k][s] for s, k in enumerate(sig)]
    g = _slowest(tabs.dims, tabs.cm)
    return g * pipeline_min_max(m.layers, [tabs.w(k, b, rec) for k in sig], caps, mb, v, v, tabs.fixed(sig, b, v),
                                rel_tol=rel_tol, cutoff=cutoff / g)


def _family_fill_bound(m: TransformerShape, sig: tuple[int, ...], b: int, v: int, opts: SearchOptions,
                       tabs: _StageTables, cutoff: float) -> dict[int, float]:
    """Per node set that can come last, a bound for every ordering of the stages on node sets
    ``sig`` that ends on it, at micro-batch b and v chunks: the pipeline bound where the last stage
    has its own memory cap, the head and its full fill term, and every other stage its largest
    cap over the other positions and (v = 1) the fill term of the position with the most forwards
    in flight; each stage sends at least 2v - 1 times, at the cheapest link to any set of the
    family. Memory rungs after one with which every ordering fits are not bounded: no
    ordering takes them (:func:`_recompute_choice`)."""
    p, mb = tabs.dims.pp, m.global_batch // (tabs.dims.dp * b)
    kinds = set(sig)
    out = dict.fromkeys(kinds, math.inf)
    if v > 1 and (p == 1 or mb % p or m.layers < p * v):
        return out
    ov = 2 * v * tabs.cm.a.chunk_overhead_s
    send = {k: (2 * v - 1) * min(tabs._part("send", (k, j), b) for j in kinds) + ov if p > 1 else 0.0 for k in kinds}
    g = _slowest(tabs.dims, tabs.cm)
    for rec in tabs.rungs:
        lists = {k: tabs.caps(k, b, v, rec) for k in kinds}
        for last in kinds:  # the stage that comes last is put at the end
            order = list(sig)
            order.remove(last)
            w = [tabs.w(k, b, rec) for k in order] + [tabs.w(last, b, rec)]
            n = [max(lists[k][:-1]) for k in order] + [lists[last][-1]]
            c = [send[k] for k in order] + [send[last] + tabs._part("head", last, b)]
            if v == 1:
                k = [(mb - 1) * x - (min(p, mb) - 1) * x / 2 for x in w[:-1]] + [(mb - 1) * w[-1]]
            else:
                k = [0.0] * (p - 1) + [mb * w[-1] - w[-1] / v]
            out[last] = min(out[last], g * pipeline_min_max(m.layers, w, n, mb, v, v, c, cutoff=cutoff / g, k=k))
        if _fits_every_order(m, sig, v, lists):
            break
    return out


def _group_bound(m: TransformerShape, comp: dict[str, int], nts: dict, dims: ParallelDims, sizes, cm: CostModel,
                 opts: SearchOptions) -> float:
    """A bound for every plan of one composition and layout, whatever the placement and partition:
    B*L layer-samples shared by groups of tp*cp GPUs of total rate ``R = sum_g n_g / tau_g`` (tau
    at the best allowed micro-batch size) take at least ``B*L / R``."""
    rate = sum(k * nts[n].gpus_per_node / (dims.tp * dims.cp) / min(_tau(m, nts[n], dims, b, cm, opts) for b in sizes)
               for n, k in comp.items())
    return m.global_batch * m.layers / rate * _slowest(dims, cm)


def _groups(m: TransformerShape, cluster: Cluster, opts: SearchOptions, cm: CostModel):
    """Yield (time bound, (composition, node types, dims, micro-batch sizes, price))."""
    for comp in compositions(cluster, opts.all_nodes):
        nts = {name: cluster.by_name(name) for name in comp}
        price = sum(nts[n].price * k for n, k in comp.items())
        if opts.objective == "throughput" and price > opts.cost_limit:
            continue
        if opts.fp8 and not all(nt.gpu.fp8_tflops for nt in nts.values()):
            continue  # every rank runs the same recipe
        n_gpus = sum(nts[n].gpus_per_node * k for n, k in comp.items())
        for dims in _layouts(m, n_gpus, [nt.gpus_per_node for nt in nts.values()], opts):
            per_replica = m.global_batch // dims.dp
            sizes = [b for b in divisors(per_replica) if b <= opts.max_mbs and (not opts.mbs or b in opts.mbs)]
            if sizes:
                yield _group_bound(m, comp, nts, dims, sizes, cm, opts), (comp, nts, dims, sizes, price)


def multinomial(counts) -> int:
    """Distinct orderings of a multiset with these multiplicities: n! / prod(k_i!)."""
    out = math.factorial(sum(counts))
    for k in counts:
        out //= math.factorial(k)
    return out


def block_orderings(comp: dict[str, int], limit: int) -> tuple[list[tuple[str, ...]], int]:
    """All distinct orderings of the nodes when there are at most ``limit`` of them (block size 1);
    otherwise the orderings of blocks of k same-type nodes (one smaller block for a remainder),
    k the smallest block size that brings their number within the limit."""
    k = 1
    while True:
        blocks: dict = {}
        for name, n in comp.items():
            q, r = divmod(n, k)
            if q:
                blocks[(name, k)] = q
            if r:
                blocks[(name, r)] = blocks.get((name, r), 0) + 1
        if multinomial(blocks.values()) <= limit or k >= max(comp.values()):
            break
        k += 1
    if k == 1:
        return distinct_orderings(comp), 1
    expanded = (tuple(name for name, size in o for _ in range(size)) for o in distinct_orderings(blocks))
    return list(dict.fromkeys(expanded)), k


def _gatherings(group, opts: SearchOptions, cm: CostModel, stats: dict):
    """A group's placements gathered by the node types each stage falls on:
    yield (per stage node-type names, placements)."""
    comp, nts, dims, _, _ = group
    key = ("orderings", tuple(sorted(comp.items())))
    orderings = cm.cache.get(key)
    if orderings is None:
        names, k = block_orderings(comp, opts.max_orderings)
        stats["block_size"] = max(stats["block_size"], k)
        orderings = cm.cache[key] = [tuple(nts[n] for n in o) for o in names]
    stats["placements"] += len(orderings)
    G = dims.world_size // dims.pp  # layouts with the same stage size and pp gather alike (tp, cp differ)
    key = ("gathered", key[1], G, dims.pp)
    by_types = cm.cache.get(key)
    if by_types is None:
        by_types = cm.cache[key] = {}
        for order in orderings:
            by_types.setdefault(stage_node_names(order, G, dims.pp), []).append(order)
    yield from by_types.items()


def search(m: TransformerShape, cluster: Cluster, opts: SearchOptions = SearchOptions(), cm: CostModel | None = None,
           progress=None) -> SearchResult:
    """The best ``opts.top`` feasible plans for ``m`` on ``cluster`` (see module docstring).

    Best-first branch and bound over one heap of entries, each popped in order of a valid lower
    bound on the time of every plan below it, refined level by level:

    - group: composition + tp/pp/dp (:func:`_group_bound`) -> families of gatherings;
    - family: gatherings whose stages fall on the same multiset of node types, per micro-batch
      size (:func:`_free_bound`; on first pop, with v = 1 and several orderings, tightened by
      :func:`_family_fill_bound`, per node set that comes last, and queued again) -> its gatherings;
    - gathering: placements with the same node types per stage, per micro-batch size and v (the
      recomputation choice from the memory caps, :func:`_recompute_choice`; on pop checked against
      the cutoff by :func:`_fill_bound`, the pipeline's busy time, fill and drain, and queued
      again when that bound rose; checked again if the cutoff falls) -> one lazy configuration
      per stage view;
    - lazy: built into a PlanContext on pop, re-pushed with PlanContext.quick_bound;
    - config: partitioned; each partition gets PlanContext.lower_bound and is simulated.

    The search stops when the smallest bound left cannot beat the current ``top``-th plan, so the
    result is the exact optimum of the cost model. With ``recompute="auto"`` a configuration's next
    recomputation rung is queued only when it fits no partition with the one before.

    ``progress(bound, best, stats)``, when given, is called every 64 steps with the
    objective bound being explored and the ``top``-th best found (inf before that).
    """
    t0 = time.perf_counter()
    cm = cm or CostModel(m)
    stats = {"block_size": 1, "groups": 0, "gatherings": 0, "placements": 0, "views": 0, "configs": 0, "partitioned": 0,
             "candidates": 0, "simulated": 0}
    seq = itertools.count()
    heap = []
    for lb, g in _groups(m, cluster, opts, cm):
        price = g[4]
        heap.append((objective_value(opts, lb, price), lb, next(seq), "group", g))
    heapq.heapify(heap)
    intern: dict = {}
    view_cache: dict = {}  # (id(placements of a gathering), dims) -> (them, {stage views: placement})
    best: list[tuple[float, float, PlanResult]] = []
    keys = set()

    def cutoff(price: float) -> float:
        """The time a plan at this price must beat to enter the top (inf while it has room)."""
        if len(best) < opts.top:
            return math.inf
        return best[-1][0] * 3600 / price if opts.objective == "cost" else best[-1][0]

    def beaten(obj: float) -> bool:
        return len(best) >= opts.top and obj >= best[-1][0]

    def push(lb: float, price: float, kind: str, item, dive: bool = False) -> None:
        """Queue an entry by its bound; ``dive`` queues it ahead of every bound (while no plan is
        known, so that one is found early and prunes the rest; order never affects exactness)."""
        obj = objective_value(opts, lb, price)
        if beaten(obj) or (opts.objective == "cost" and opts.time_limit is not None and lb > opts.time_limit):
            return
        heapq.heappush(heap, (obj - DIVE if dive else obj, lb, next(seq), kind, item))

    steps = 0
    while heap:
        obj0, lb0, _, kind, item = heapq.heappop(heap)
        steps += 1
        if progress is not None and steps % 64 == 0:
            progress(obj0 + DIVE if obj0 < 0 else obj0, best[-1][0] if len(best) >= opts.top else math.inf, stats)
        if obj0 < 0:  # explored ahead of its bound
            if beaten(obj0 + DIVE):
                continue
        elif beaten(obj0):
            break
        if opts.objective == "cost" and opts.time_limit is not None and lb0 > opts.time_limit:
            continue
        if kind == "group":
            stats["groups"] += 1
            comp, nts, dims, sizes, price = item
            tabs = _StageTables(m, dims, opts, cm)
            families: dict = {}
            for names, orders in _gatherings(item, opts, cm, stats):
                sig = tuple(tabs.set_id(x, tuple(nts[n] for n in x)) for x in names)
                families.setdefault(tuple(sorted(sig)), []).append((sig, orders))
            for members in families.values():
                stage_nodes = [tabs.sets[k] for k in members[0][0]]  # any member: the bound ignores order
                for b in sizes:
                    lb = max(_free_bound(m, dims, stage_nodes, b, cm, opts), lb0)
                    push(lb, price, "family", (item, tabs, members, b, math.inf, None))
            continue
        if kind == "family":
            group, tabs, members, b, checked, by_last = item
            comp, nts, dims, sizes, price = group
            cut = cutoff(price)
            if cut < checked and len(members) > 1:  # the fill and drain, whatever the order before the last
                by_last = {v: _family_fill_bound(m, members[0][0], b, v, opts, tabs, cut) for v in opts.virtual_stages}
                lb = min(x for d in by_last.values() for x in d.values())
                if lb >= cut:
                    continue
                if lb > lb0 and best:
                    push(lb, price, "family", (group, tabs, members, b, cut, by_last))
                    continue
                lb0 = max(lb, lb0)
            shared = {v: _shared_recompute_choice(m, members[0][0], b, v, opts, tabs) for v in opts.virtual_stages}
            for sig, orders in members:
                for v in opts.virtual_stages:
                    last = by_last[v][sig[-1]] if by_last else lb0
                    if last >= cut:
                        continue
                    rec = shared[v] if shared[v] is not None else _recompute_choice(m, sig, b, v, opts, tabs)
                    if rec is not None:
                        push(max(lb0, last), price, "gathering", (group, tabs, sig, orders, b, v, rec, math.inf))
            continue
        if kind == "gathering":
            group, tabs, sig, orders, b, v, rec, checked = item
            comp, nts, dims, sizes, price = group
            cut = cutoff(price)
            if cut < checked:  # the fill and drain: can it still beat the cutoff? (queued again if it rose)
                lb = _fill_bound(m, sig, b, v, rec, tabs, cut, rel_tol=math.inf if best else 1e-3)
                if lb >= cut:
                    continue
                if lb > lb0 and best:
                    push(lb, price, "gathering", (group, tabs, sig, orders, b, v, rec, cut))
                    continue
                lb0 = max(lb, lb0)
            views = view_cache.get((id(orders), dims), (None, None))[1]
            if views is None:
                stats["gatherings"] += 1
                views = {}
                for order in orders:
                    views.setdefault(stage_envs(order, dims, cm.a, intern), order)
                view_cache[(id(orders), dims)] = (orders, views)  # holding orders keeps its id unique
                stats["views"] += len(views)
            for envs, order in views.items():
                push(lb0, price, "lazy", (envs, order, _config(dims, b, v, rec, opts, tabs.sp), price), not best)
            continue
        if kind == "lazy":
            envs, order, cfg, price = item
            try:
                ctx = PlanContext(cm, envs, cfg)
            except PlannerError:
                continue  # batch/schedule constraints (micro-batches vs pp, layers vs chunks)
            stats["configs"] += 1
            push(max(lb0, ctx.quick_bound(cutoff(price))), price, "config", (ctx, order, price), not best)
            continue
        ctx, order, price = item
        stats["partitioned"] += 1
        seen = set()
        for method in opts.methods:
            counts = ctx.partition(method)
            if counts is None or counts in seen:
                continue
            seen.add(counts)
            stats["candidates"] += 1
            lb = ctx.lower_bound(counts)
            if beaten(objective_value(opts, lb, price)):
                continue
            if opts.objective == "cost" and opts.time_limit is not None and lb > opts.time_limit:
                continue
            r = ctx.result(counts, method, order)
            stats["simulated"] += 1
            if not r.feasible:  # partitions respect the memory caps; kept as a guard
                continue
            if opts.objective == "cost" and opts.time_limit is not None and r.iteration_s > opts.time_limit:
                continue
            if r.key() in keys:
                continue
            keys.add(r.key())
            bisect.insort(best, (objective_value(opts, r.iteration_s, r.price_per_hour), r.price_per_hour, r),
                          key=lambda x: (x[0], x[1]))
            del best[opts.top:]
        rungs = _rungs(m, opts, ctx.cfg.dims)
        nxt = rungs.index((ctx.cfg.zero, ctx.cfg.recomputation)) + 1
        if not seen and nxt < len(rungs):
            # fits nowhere with this rung: queue the next (no faster, so the same bound)
            push(lb0, price, "lazy", (ctx.envs, order, _config(ctx.cfg.dims, ctx.cfg.mbs, ctx.cfg.v, rungs[nxt], opts,
                                                                ctx.cfg.sp), price))
    stats["seconds"] = time.perf_counter() - t0
    return SearchResult([r for _, _, r in best], stats)
