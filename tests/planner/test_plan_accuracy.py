"""Regression guard: published Megatron-LM iteration times on A100 clusters (full recomputation).

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
Table 4/5, full-recompute baseline: GPT models, seq 2048, vocab 51200, tp=8, mbs=1, dp=1.
The cost model is not fitted to these; the test only keeps it from drifting.
"""

import pytest

from computron.parallel.dims import ParallelDims
from computron.planner.estimate import CostModel, PlanConfig, PlanContext
from computron.planner.hardware import parse_compact
from computron.planner.layout import stage_envs
from computron.planner.model import TransformerShape

CASES = [  # name, layers, hidden, heads, pp, global batch, published seconds per iteration
    ("22B", 48, 6144, 64, 1, 4, 1.42),
    ("175B", 96, 12288, 96, 8, 64, 18.13),
    ("530B", 105, 20480, 128, 35, 280, 49.05),
    ("1T", 128, 25600, 160, 64, 512, 94.42),
]


@pytest.mark.parametrize("name,L,h,a,pp,B,published", CASES)
def test_korthikanti_full_recompute(name, L, h, a, pp, B, published):
    m = TransformerShape(name, "gpt", L, h, a, 4 * h, 51200, 2048, B)
    nodes = pp  # tp=8 fills one 8-GPU node per stage
    cl = parse_compact(f"a100-80gb:8x{nodes}")
    placement = (cl.node_types[0],) * nodes
    dims = ParallelDims(dp=1, tp=8, pp=pp)
    cm = CostModel(m)
    ctx = PlanContext(cm, stage_envs(placement, dims, cm.a), PlanConfig(dims, 1, 1, True))
    r = ctx.result(ctx.partition("balanced"), "balanced", placement)
    assert r.feasible
    assert r.iteration_s == pytest.approx(published, rel=0.10)
