"""From a node placement and (tp, cp, pp, dp) to what each pipeline stage sees.

What flows through: a placement (an ordered tuple of node types, one entry per node) and a
``ParallelDims`` go in; per stage, a :class:`StageEnv` comes out: its GPU/node types, the bus
bandwidth of its data-parallel ring, of the links of its context-parallel ring, of its links to the
neighbouring stages and, for the first stage, of the tied-embedding link to the last stage.

Rank layout (Megatron's tp-cp-dp-pp order): GPUs are numbered node after node in placement
order, and ``rank = stage*dp*cp*tp + replica*cp*tp + cp_index*tp + tp_index``, so TP groups are
consecutive ranks (always inside one node, since tp divides every node's GPU count), a context
group is cp consecutive TP groups and a stage is a contiguous block of dp*cp*tp ranks, possibly
spanning several nodes and GPU types. Gradients are reduced (and ZeRO shards) over the dp*cp
ranks holding the same TP shard, as Megatron-LM does.

Ring bandwidths: inside one node a ring runs at ``intra_bw * intra_eff``. A ring that leaves a
node uses, on each node n it touches, the NICs of the r_n members it has there (NCCL opens one
channel per NIC): ``min_n min(r_n * nic_per_gpu_n * inter_eff, intra_bw_n * intra_eff)``; the
slowest node it crosses sets the ring's speed.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from itertools import product

from computron.parallel.dims import ParallelDims

from .costs import Assumptions
from .errors import PlannerError
from .hardware import Cluster, NodeType
from .model import TransformerShape


_UIDS = itertools.count()


@dataclass(frozen=True, eq=False)
class StageEnv:
    """One stage's hardware view (bandwidths in bytes/s with efficiencies applied, latencies in s).

    Compared and hashed by identity: :func:`stage_envs` interns equal views (same nodes, same
    links) into one object per search, so they key caches cheaply.
    """

    nodes: tuple[NodeType, ...]  # distinct node types holding this stage's GPUs
    dp_bw: float  # the ring over the dp*cp ranks holding one TP shard
    dp_latency: float
    next_bw: float  # link to stage (s+1) mod p, one GPU's share
    next_crosses: bool
    emb_bw: float  # first stage only: link to the last stage (tied embeddings)
    emb_latency: float
    cp_bw: float = 0.0  # the slowest context-parallel ring (cp > 1)
    cp_latency: float = 0.0
    uid: int = field(default_factory=lambda: next(_UIDS))

    def __hash__(self) -> int:
        return self.uid

    @property
    def gpu_names(self) -> str:
        return "+".join(sorted({n.gpu.name for n in self.nodes}))


def check_dims(m: TransformerShape, dims: ParallelDims, gpus_per_node: list[int]) -> None:
    """Raise PlannerError when ``dims`` cannot shard ``m`` or fit TP groups inside nodes."""
    try:
        dims.validate_for(num_layers=m.layers, num_heads=m.heads, num_kv_heads=m.kv)
    except ValueError as e:
        raise PlannerError(f"{m.name}: {e}") from None
    if dims.cp > 1:
        if not m.flash_attention:
            raise PlannerError(f"{m.name}: context parallelism (cp={dims.cp}) needs fused attention (flash_attention)")
        if m.seq_len % (2 * dims.cp):
            raise PlannerError(f"{m.name}: cp={dims.cp} needs the sequence length {m.seq_len} divisible by 2*cp "
                               f"(two load-balanced causal chunks per rank)")
    if m.ffn % dims.tp:
        raise PlannerError(f"{m.name}: tp={dims.tp} does not divide the FFN size {m.ffn}")
    for g in gpus_per_node:
        if g % dims.tp:
            raise PlannerError(f"tp={dims.tp} does not divide a node's {g} GPUs (TP groups must stay inside a node)")


def distinct_orderings(counts: dict[str, int]) -> list[tuple[str, ...]]:
    """All distinct orderings of a multiset of node-type names (n! / prod(k_i!) of them),
    in lexicographic order, by repeated next-permutation."""
    seq = sorted(name for name, k in counts.items() for _ in range(k))
    out = [tuple(seq)]
    n = len(seq)
    while True:
        i = n - 2
        while i >= 0 and seq[i] >= seq[i + 1]:
            i -= 1
        if i < 0:
            return out
        j = n - 1
        while seq[j] <= seq[i]:
            j -= 1
        seq[i], seq[j] = seq[j], seq[i]
        seq[i + 1:] = reversed(seq[i + 1:])
        out.append(tuple(seq))


def compositions(cluster: Cluster, all_nodes: bool) -> list[dict[str, int]]:
    """Node counts to consider: all nodes only, or every non-empty sub-multiset of the cluster."""
    if all_nodes:
        return [{n.name: n.count for n in cluster.node_types if n.count}]
    ranges = [range(n.count + 1) for n in cluster.node_types]
    out = []
    for ks in product(*ranges):
        if any(ks):
            out.append({n.name: k for n, k in zip(cluster.node_types, ks) if k})
    return out


def stage_node_names(placement: tuple[NodeType, ...], G: int, pp: int) -> tuple[tuple[str, ...], ...]:
    """Per stage, the node-type names its G consecutive GPUs fall on (cheap: no bandwidths)."""
    out = []
    i, start, n = 0, 0, len(placement)
    for s in range(pp):
        lo, hi = s * G, (s + 1) * G
        while start + placement[i].gpus_per_node <= lo:
            start += placement[i].gpus_per_node
            i += 1
        names, j, st = set(), i, start
        while j < n and st < hi:
            names.add(placement[j].name)
            st += placement[j].gpus_per_node
            j += 1
        out.append(tuple(sorted(names)))
    return tuple(out)


def _ring_bw(members: Counter, nodes: list[NodeType], a: Assumptions) -> tuple[float, float]:
    """(bus bandwidth, per-step latency) of a ring over ranks counted per node index."""
    if len(members) == 1:
        (idx,) = members
        return nodes[idx].intra_bw * a.intra_eff, a.intra_latency_s
    bw = min(min(r * nodes[i].nic_per_gpu * a.inter_eff, nodes[i].intra_bw * a.intra_eff) for i, r in members.items())
    return bw, a.inter_latency_s


def _pair_bw(pairs, nodes: list[NodeType], a: Assumptions) -> tuple[float, bool]:
    """One GPU's share of the slowest link among simultaneous rank-to-rank transfers."""
    bw, cross = float("inf"), False
    for x, y in pairs:
        if x == y:
            bw = min(bw, nodes[x].intra_bw * a.intra_eff)
        else:
            cross = True
            bw = min(bw, min(nodes[x].nic_per_gpu, nodes[y].nic_per_gpu) * a.inter_eff)
    return bw, cross


def stage_envs(placement: tuple[NodeType, ...], dims: ParallelDims, a: Assumptions,
               intern: dict | None = None) -> tuple[StageEnv, ...]:
    """Per stage hardware view of ``placement`` (one NodeType per node, in rank order) under ``dims``.

    ``intern`` (a dict kept for one search) makes equal views the same object.
    """
    node_of = [i for i, n in enumerate(placement) for _ in range(n.gpus_per_node)]
    tp, dp, pp, cp = dims.tp, dims.dp, dims.pp, dims.cp
    G = tp * cp * dp
    if len(node_of) != G * pp:
        raise PlannerError(f"placement has {len(node_of)} GPUs but tp*cp*dp*pp = {G * pp}")
    nodes = list(placement)
    envs = []
    for s in range(pp):
        base = s * G
        here = {nodes[node_of[r]] for r in range(base, base + G)}
        dp_bw, dp_lat = _ring_bw(Counter(node_of[base + i * tp] for i in range(dp * cp)), nodes, a)
        cp_bw, cp_lat = 0.0, 0.0
        if cp > 1:  # each ring step, every rank sends one block to the next: the slowest neighbour link
            ring = [[node_of[base + (i * cp + j) * tp] for j in range(cp)] for i in range(dp)]
            cp_bw, cr = _pair_bw({(r[j], r[(j + 1) % cp]) for r in ring for j in range(cp)}, nodes, a)
            cp_lat = a.inter_latency_s if cr else a.intra_latency_s
        nb = ((s + 1) % pp) * G
        nxt_bw, crosses = _pair_bw({(node_of[base + k], node_of[nb + k]) for k in range(G)}, nodes, a)
        emb_bw, emb_lat = 0.0, 0.0
        if s == 0 and pp > 1:
            lb = (pp - 1) * G
            emb_bw, cr = _pair_bw({(node_of[k], node_of[lb + k]) for k in range(G)}, nodes, a)
            emb_lat = a.inter_latency_s if cr else a.intra_latency_s
        here_t = tuple(sorted(here, key=lambda n: n.name))
        fields = (dp_bw, dp_lat, nxt_bw, crosses, emb_bw, emb_lat, cp_bw, cp_lat)
        if intern is None:
            envs.append(StageEnv(here_t, *fields))
            continue
        sig = (tuple(id(n) for n in here_t), *fields)
        env = intern.get(sig)
        if env is None:
            env = intern[sig] = StageEnv(here_t, *fields)
        envs.append(env)
    return tuple(envs)


def placement_text(names) -> str:
    """Run-length text of a placement (node-type names or NodeTypes), e.g. ``a100-80gb*2,v100*2``."""
    out: list[list] = []
    for n in names:
        n = getattr(n, "name", n)
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return ",".join(f"{name}*{k}" if k > 1 else name for name, k in out)


def parse_placement(text: str, cluster: Cluster) -> tuple[NodeType, ...]:
    """Inverse of :func:`placement_text`: ``a100-80gb*2,v100`` -> node types, checked against availability."""
    out: list[NodeType] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, _, k = item.partition("*")
        try:
            reps = int(k) if k else 1
        except ValueError:
            raise PlannerError(f"malformed placement item {item!r}; expected NODE or NODE*COUNT") from None
        out.extend([cluster.by_name(name.strip())] * reps)
    used = Counter(n.name for n in out)
    for name, k in used.items():
        if k > cluster.by_name(name).count:
            raise PlannerError(f"placement uses {k} {name} nodes but the cluster has {cluster.by_name(name).count}")
    return tuple(out)
