"""GPU types, node types and clusters: datasheet presets, YAML files and the compact spec.

What flows through: a ``--cluster`` argument (a YAML path or a compact spec such as
``a100-80gb:8x4,a10:4x12``) becomes a :class:`Cluster`, a tuple of :class:`NodeType` with counts.
Every bandwidth is stored in bytes/s, every memory in bytes, prices in USD per node-hour.

Datasheet figures (dense fp16/bf16 and, where the GPU has them, fp8 tensor-core peaks, memory,
HBM bandwidth) come from NVIDIA's product datasheets (the fp8 figures are the datasheets' "FP8
Tensor Core" numbers, which are quoted with 2:4 sparsity, halved to dense). ``gemm_eff`` is the fraction of that peak a large transformer GEMM sustains;
it is an assumption documented per type in docs/planner.md (A100: checked against the
Megatron-LM papers' published throughputs; others estimated from power limits and public GEMM
benchmarks). Node defaults (GPUs per node, links, price) describe the usual server of that GPU
and are overridable from YAML.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from .errors import PlannerError

GB = 1e9  # bandwidths: decimal GB/s
GIB = 1024**3  # memories: GiB


@dataclass(frozen=True)
class GpuType:
    """One GPU model: ``tflops`` dense fp16/bf16 peak, ``memory`` bytes, ``hbm_bw`` bytes/s,
    ``fp8_tflops`` dense fp8 peak (0: no fp8 tensor cores)."""

    name: str
    tflops: float
    memory: float
    hbm_bw: float
    gemm_eff: float  # sustained fraction of ``tflops`` that large GEMMs approach (costs.gemm_efficiency)
    bf16: bool = True  # V100 has no bf16 tensor cores
    fp8_tflops: float = 0.0

    def peak_flops(self, dtype: str, fp8: bool = False) -> float:
        if dtype == "bfloat16" and not self.bf16:
            raise PlannerError(f"GPU type {self.name} has no bfloat16 tensor cores; use dtype float16")
        if fp8:
            if not self.fp8_tflops:
                raise PlannerError(f"GPU type {self.name} has no fp8 tensor cores; plan it without --fp8")
            return self.fp8_tflops * 1e12
        return self.tflops * 1e12


# name: (dense fp16/bf16 TFLOP/s, memory GiB, HBM GB/s, assumed GEMM efficiency, bf16?, dense fp8 TFLOP/s)
_GPU_TABLE = {
    "v100": (125.0, 32, 900, 0.75, False, 0.0),  # V100 SXM2 32GB
    "a10": (125.0, 24, 600, 0.60, True, 0.0),  # 150 W card, sustains well under peak
    "a100-40gb": (312.0, 40, 1555, 0.87, True, 0.0),  # A100 SXM4 40GB (asymptote fitted, docs/planner.md)
    "a100-80gb": (312.0, 80, 2039, 0.87, True, 0.0),  # A100 SXM4 80GB (asymptote fitted, docs/planner.md)
    "l4": (121.0, 24, 300, 0.50, True, 242.5),  # 72 W card, power-limited; fp8 485 sparse
    "h100": (989.0, 80, 3350, 0.72, True, 1979.0),  # H100 SXM5; fp8 3,958 sparse
    "h200": (989.0, 141, 4800, 0.72, True, 1979.0),  # H200 SXM; fp8 3,958 sparse
}

GPU_TYPES: dict[str, GpuType] = {
    name: GpuType(name, tf, mem * GIB, bw * GB, eff, bf16, fp8)
    for name, (tf, mem, bw, eff, bf16, fp8) in _GPU_TABLE.items()
}


@dataclass(frozen=True)
class NodeDefaults:
    """The usual server of one GPU type: GPUs, per-GPU links and USD per GPU-hour."""

    gpus_per_node: int
    intra_GBps: float  # per GPU, one direction, inside the node (NVLink or PCIe)
    nic_Gbps_per_gpu: float  # network bandwidth out of the node, per GPU
    usd_per_gpu_hour: float  # approximate cloud on-demand list price


NODE_DEFAULTS: dict[str, NodeDefaults] = {
    "v100": NodeDefaults(8, 150.0, 50.0, 3.06),  # DGX-1 class: NVLink2, 4x100 Gb/s IB per 8 GPUs
    "a10": NodeDefaults(4, 32.0, 25.0, 1.42),  # PCIe Gen4 x16, 100 Gb/s Ethernet per 4 GPUs
    "a100-40gb": NodeDefaults(8, 300.0, 200.0, 4.10),  # NVLink3/NVSwitch, 8x200 Gb/s HDR IB
    "a100-80gb": NodeDefaults(8, 300.0, 200.0, 5.12),  # NVLink3/NVSwitch, 8x200 Gb/s HDR IB
    "l4": NodeDefaults(8, 32.0, 12.5, 1.10),  # PCIe Gen4, 100 Gb/s Ethernet per 8 GPUs
    "h100": NodeDefaults(8, 450.0, 400.0, 12.29),  # NVLink4/NVSwitch, 8x400 Gb/s NDR IB
    "h200": NodeDefaults(8, 450.0, 400.0, 13.50),  # NVLink4/NVSwitch, 8x400 Gb/s NDR IB
}


@dataclass(frozen=True)
class NodeType:
    """A kind of node in the cluster and how many of it are available.

    ``intra_bw``: bytes/s per GPU per direction inside the node; ``inter_bw``: bytes/s out of the
    whole node (sum of its NICs); ``price``: USD per node-hour.
    """

    name: str
    gpu: GpuType
    gpus_per_node: int
    count: int
    intra_bw: float
    inter_bw: float
    price: float

    @property
    def nic_per_gpu(self) -> float:
        return self.inter_bw / self.gpus_per_node

    def __str__(self) -> str:
        return f"{self.name}:{self.gpus_per_node}x{self.count}"


@dataclass(frozen=True)
class Cluster:
    """The available nodes: one entry per node type (names unique)."""

    node_types: tuple[NodeType, ...]

    def __post_init__(self) -> None:
        names = [n.name for n in self.node_types]
        if not names:
            raise PlannerError("the cluster has no nodes")
        if len(set(names)) != len(names):
            raise PlannerError(f"node type names must be unique, got {names}")

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus_per_node * n.count for n in self.node_types)

    def by_name(self, name: str) -> NodeType:
        for n in self.node_types:
            if n.name == name:
                return n
        raise PlannerError(f"unknown node type {name!r} in this cluster (have {', '.join(x.name for x in self.node_types)})")

    def __str__(self) -> str:
        return ",".join(str(n) for n in self.node_types)


def gpu_type(name: str, custom: dict[str, GpuType] | None = None) -> GpuType:
    """Look a GPU type up by name (case-insensitive); the error lists the known names."""
    key = name.strip().lower()
    table = {**GPU_TYPES, **(custom or {})}
    if key not in table:
        raise PlannerError(f"unknown GPU type {name!r}; known GPU types: {', '.join(sorted(table))}")
    return table[key]


def make_node_type(gpu: GpuType, gpus_per_node: int | None, count: int, *, name: str | None = None,
                   intra_GBps: float | None = None, inter_Gbps: float | None = None,
                   price_per_hour: float | None = None) -> NodeType:
    """Build a node type, filling what is not given from the GPU's usual server (NODE_DEFAULTS)."""
    d = NODE_DEFAULTS.get(gpu.name, NodeDefaults(8, 32.0, 25.0, 2.0))
    g = d.gpus_per_node if gpus_per_node is None else int(gpus_per_node)
    if g < 1:
        raise PlannerError(f"{gpu.name}: GPUs per node must be at least 1, got {g}")
    if int(count) < 0:
        raise PlannerError(f"{gpu.name}: node count must be non-negative, got {count}")
    intra = d.intra_GBps if intra_GBps is None else float(intra_GBps)
    inter = d.nic_Gbps_per_gpu * g if inter_Gbps is None else float(inter_Gbps)
    price = d.usd_per_gpu_hour * g if price_per_hour is None else float(price_per_hour)
    if intra <= 0 or inter <= 0 or price < 0:
        raise PlannerError(f"{gpu.name}: bandwidths must be positive and the price non-negative")
    return NodeType(name or gpu.name, gpu, g, int(count), intra * GB, inter * GB / 8, price)


_COMPACT = re.compile(r"^([A-Za-z0-9_.\-]+):(\d+)[xX*](\d+)$")


def parse_compact(spec: str) -> Cluster:
    """Parse ``GPU:GPUSxNODES[,GPU:GPUSxNODES...]``, e.g. ``a100-80gb:8x4,a10:4x12``."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise PlannerError("empty cluster spec; expected GPU:GPUSxNODES such as a100-80gb:8x4")
    nodes = []
    for item in items:
        m = _COMPACT.match(item)
        if not m:
            hint = ""
            if ":" not in item:
                hint = " (missing ':GPUSxNODES')"
            elif "x" not in item.split(":", 1)[1].lower():
                hint = " (missing 'x' between GPUs per node and node count)"
            raise PlannerError(f"malformed node spec {item!r}{hint}; expected GPU:GPUSxNODES such as a100-80gb:8x4")
        gpu = gpu_type(m.group(1))
        per, count = int(m.group(2)), int(m.group(3))
        if per < 1 or count < 1:
            raise PlannerError(f"node spec {item!r}: GPUs per node and node count must be at least 1")
        nodes.append(make_node_type(gpu, per, count))
    return Cluster(tuple(_merge_same_name(nodes)))


def _merge_same_name(nodes: list[NodeType]) -> list[NodeType]:
    """Give repeated GPU names distinct node-type names (``a100-80gb``, ``a100-80gb#2``)."""
    seen: dict[str, int] = {}
    out = []
    for n in nodes:
        k = seen.get(n.name, 0) + 1
        seen[n.name] = k
        out.append(n if k == 1 else replace(n, name=f"{n.name}#{k}"))
    return out


def cluster_from_dict(data: dict) -> Cluster:
    """Build a cluster from parsed YAML: ``{gpus: {custom types}, nodes: [{gpu, gpus_per_node, count, ...}]}``."""
    if not isinstance(data, dict) or "nodes" not in data:
        raise PlannerError("cluster YAML needs a 'nodes' list")
    custom = {}
    for name, g in (data.get("gpus") or {}).items():
        try:
            custom[name.lower()] = GpuType(name.lower(), float(g["tflops"]), float(g["memory_gib"]) * GIB,
                                           float(g["hbm_GBps"]) * GB, float(g.get("gemm_eff", 0.7)),
                                           bool(g.get("bf16", True)), float(g.get("fp8_tflops", 0.0)))
        except (KeyError, TypeError) as e:
            raise PlannerError(f"custom GPU {name!r} needs tflops, memory_gib and hbm_GBps ({e})") from None
    allowed = {"gpu", "name", "gpus_per_node", "count", "intra_GBps", "inter_Gbps", "price_per_hour", "gemm_eff"}
    nodes = []
    for i, nd in enumerate(data["nodes"] or []):
        if not isinstance(nd, dict) or "gpu" not in nd:
            raise PlannerError(f"cluster node entry {i} needs a 'gpu' field")
        extra = set(nd) - allowed
        if extra:
            raise PlannerError(f"cluster node entry {i}: unknown fields {sorted(extra)} (allowed: {sorted(allowed)})")
        gpu = gpu_type(str(nd["gpu"]), custom)
        if "gemm_eff" in nd:
            gpu = replace(gpu, gemm_eff=float(nd["gemm_eff"]))
        nodes.append(make_node_type(gpu, nd.get("gpus_per_node"), nd.get("count", 1), name=nd.get("name"),
                                    intra_GBps=nd.get("intra_GBps"), inter_Gbps=nd.get("inter_Gbps"),
                                    price_per_hour=nd.get("price_per_hour")))
    return Cluster(tuple(_merge_same_name(nodes)))


def load_cluster(arg: str) -> Cluster:
    """``--cluster``: a YAML file path (``.yaml``/``.yml`` or an existing file) or a compact spec."""
    if arg.endswith((".yaml", ".yml")) or os.path.isfile(arg):
        import yaml

        if not os.path.isfile(arg):
            raise PlannerError(f"cluster file {arg!r} does not exist")
        with open(arg) as f:
            return cluster_from_dict(yaml.safe_load(f))
    return parse_compact(arg)
