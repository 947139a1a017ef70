"""Planner: the best data/tensor/pipeline layout of a Transformer's training on a (heterogeneous) cluster.

Pure CPU and torch-free (only ``planner.profile`` imports torch, inside its functions).
Modules, in the order data flows through them:

- ``hardware``: GPU and node presets, cluster YAML and compact specs -> Cluster
- ``model``: model presets and YAML -> TransformerShape
- ``costs``: the cost formulas (roofline compute, collectives, p2p, optimizer, memory)
- ``measured``: measured per-layer profiles (from ``plan profile``) in place of the roofline
- ``layout``: placement + ParallelDims -> what each pipeline stage sees (StageEnv)
- ``partition``: layers -> stages (balanced, greedy, exact DP)
- ``schedule``: 1F1B and interleaved 1F1B, simulated op by op
- ``estimate``: one plan's time, breakdown, memory and cost (PlanContext -> PlanResult)
- ``search``: branch-and-bound search over the whole space (``search.search``); ``pareto``: cost vs throughput
- ``report``, ``cli``: tables, CSV/JSON/PNG and ``computron plan ...``
"""

from .costs import Assumptions
from .errors import PlannerError
from .estimate import CostModel, PlanConfig, PlanContext, PlanResult
from .hardware import GPU_TYPES, Cluster, NodeType, load_cluster, parse_compact
from .model import PRESETS, TransformerShape, load_model
from .search import SearchOptions

__all__ = ["Assumptions", "PlannerError", "CostModel", "PlanConfig", "PlanContext", "PlanResult", "GPU_TYPES",
           "Cluster", "NodeType", "load_cluster", "parse_compact", "PRESETS", "TransformerShape", "load_model",
           "SearchOptions"]
