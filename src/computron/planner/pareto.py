"""Cost against throughput over cluster compositions, and its Pareto front.

What flows through: node types (``a100-80gb,v100:8x2``: GPU type, optional GPUs per node and
optional cap on that type's node count) and a total node budget go in; every composition
(node counts per type, 1..max_nodes nodes in all) gets the fastest plan that uses all its nodes
(search with ``all_nodes``); out come points (throughput in tokens/s, USD per million tokens,
USD per hour) and the front of points no other point beats on both throughput and cost.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, replace

from .errors import PlannerError
from .estimate import CostModel, PlanResult
from .hardware import Cluster, NodeType, gpu_type, make_node_type
from .model import TransformerShape
from .search import SearchOptions, search

_ITEM = re.compile(r"^([A-Za-z0-9_.\-]+)(?::(\d+)(?:[xX*](\d+))?)?$")


@dataclass
class ParetoPoint:
    composition: dict[str, int]
    gpus: int
    price_per_hour: float
    plan: PlanResult | None  # None: no feasible plan on this composition

    @property
    def tokens_per_s(self) -> float:
        return self.plan.tokens_per_s if self.plan else 0.0

    @property
    def usd_per_mtok(self) -> float:
        return self.plan.usd_per_mtok if self.plan else float("inf")

    @property
    def label(self) -> str:
        return "+".join(f"{k}x{n}" for n, k in self.composition.items())


def parse_node_types(text: str) -> tuple[list[NodeType], list[int | None]]:
    """``GPU[:GPUS[xMAXNODES]]`` items -> node types (count 0) and per-type node caps."""
    types, caps = [], []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        m = _ITEM.match(item)
        if not m:
            raise PlannerError(f"malformed node type {item!r}; expected GPU, GPU:GPUS or GPU:GPUSxMAXNODES (e.g. a100-80gb:8x4)")
        g = gpu_type(m.group(1))
        per = int(m.group(2)) if m.group(2) else None
        types.append(make_node_type(g, per, 0))
        caps.append(int(m.group(3)) if m.group(3) else None)
    if not types:
        raise PlannerError("no node types given")
    names = [t.name for t in types]
    if len(set(names)) != len(names):
        raise PlannerError(f"node types repeated: {names}")
    return types, caps


def compositions_upto(caps: list[int], max_nodes: int) -> list[tuple[int, ...]]:
    """Count vectors with ``0 <= k_i <= caps[i]`` and ``1 <= sum <= max_nodes``."""
    if max_nodes < 1:
        raise PlannerError("max-nodes must be at least 1")
    out = []
    for ks in itertools.product(*[range(min(c, max_nodes) + 1) for c in caps]):
        if 1 <= sum(ks) <= max_nodes:
            out.append(ks)
    return out


def sweep(m: TransformerShape, types: list[NodeType], caps: list[int | None], max_nodes: int,
          opts: SearchOptions = SearchOptions(), cm: CostModel | None = None) -> list[ParetoPoint]:
    """Fastest feasible plan of every composition (each uses all its nodes)."""
    cm = cm or CostModel(m)
    opts = replace(opts, objective="time", top=1, all_nodes=True, cost_limit=None, time_limit=None)
    points = []
    for ks in compositions_upto([max_nodes if c is None else c for c in caps], max_nodes):
        used = [replace(t, count=k) for t, k in zip(types, ks) if k]
        cluster = Cluster(tuple(used))
        res = search(m, cluster, opts, cm)
        points.append(ParetoPoint({t.name: t.count for t in used}, cluster.total_gpus,
                                  sum(t.price * t.count for t in used), res.plans[0] if res.plans else None))
    return points


def dominates(a: ParetoPoint, b: ParetoPoint) -> bool:
    """a is at least as fast and as cheap per token as b, and strictly better in one."""
    return (a.tokens_per_s >= b.tokens_per_s and a.usd_per_mtok <= b.usd_per_mtok
            and (a.tokens_per_s > b.tokens_per_s or a.usd_per_mtok < b.usd_per_mtok))


def pareto_front(points: list[ParetoPoint]) -> list[ParetoPoint]:
    """Feasible points no other point dominates, by increasing throughput."""
    ok = [p for p in points if p.plan is not None]
    ok.sort(key=lambda p: (-p.tokens_per_s, p.usd_per_mtok))
    front, best_cost = [], float("inf")
    for p in ok:  # fastest first: keep a point only if it is cheaper than every faster one
        if p.usd_per_mtok < best_cost:
            front.append(p)
            best_cost = p.usd_per_mtok
    return front[::-1]


def plot(points: list[ParetoPoint], front: list[ParetoPoint], path: str, title: str) -> None:
    """Scatter of all compositions with the front drawn as a line; PNG via matplotlib's Agg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [p for p in points if p.plan is not None]
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    ax.scatter([p.tokens_per_s for p in ok], [p.usd_per_mtok for p in ok], s=18, c="0.6", label="compositions")
    ax.plot([p.tokens_per_s for p in front], [p.usd_per_mtok for p in front], "o-", c="C3", label="Pareto front")
    for p in front:
        ax.annotate(p.label, (p.tokens_per_s, p.usd_per_mtok), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("throughput (tokens/s)")
    ax.set_ylabel("cost (USD per million tokens)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def point_row(p: ParetoPoint, on_front: bool) -> dict:
    r = p.plan
    return {"composition": p.label, "gpus": p.gpus, "price_per_hour": round(p.price_per_hour, 4),
            "feasible": r is not None, "pareto": on_front,
            "tokens_per_s": round(p.tokens_per_s, 1), "usd_per_mtok": round(p.usd_per_mtok, 6) if r else None,
            "iteration_s": round(r.iteration_s, 6) if r else None,
            "layout": f"tp={r.dims.tp} pp={r.dims.pp} dp={r.dims.dp} mbs={r.config.mbs}" if r else "",
            "placement": ",".join(r.placement) if r else "", "partition": "/".join(map(str, r.partition)) if r else ""}
