"""All-reduce and send/recv measured between ranks (gloo on the CPU here) and the bandwidths the
planner's cost model assumes for the same ranks, read where the cost model reads them."""

import math

import pytest

from computron.parallel.dims import ParallelDims
from computron.planner import costs
from computron.planner.estimate import CostModel, PlanConfig, PlanContext
from computron.planner.hardware import load_cluster
from computron.planner.layout import stage_envs
from computron.planner.model import load_model
from computron.train import links
from computron.train.accuracy import assumptions


def test_links_are_measured_over_two_gloo_ranks():
    got = links.measure(2, "cpu", sizes=(4096, 65536), warmup=1, repeats=3, inner=2)
    assert (got["ranks"], got["backend"]) == (2, "gloo")
    assert [r["bytes"] for r in got["sizes"]] == [4096, 65536]
    for r in got["sizes"]:
        assert set(r) == {"bytes", "allreduce_s", "allreduce_bus_bw", "allreduce_issue_s", "p2p_s", "p2p_bw"}
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in r)
        assert r["allreduce_bus_bw"] == pytest.approx(r["bytes"] / r["allreduce_s"])  # 2(n-1)/n = 1 on two ranks
        assert r["p2p_bw"] == pytest.approx(r["bytes"] / r["p2p_s"])
    a = assumptions()
    report = links.compare(got, links.assumed("h100", 2, a), a)
    last = report["sizes"][-1]
    assert last["allreduce_assumed_s"] == costs.ring_allreduce(65536, 2, report["assumed"]["allreduce_bus_bw"],
                                                               report["assumed"]["allreduce_step_latency_s"])
    assert report["largest_allreduce_fraction"] == last["allreduce_bus_bw"] / report["assumed"]["allreduce_bus_bw"]
    with pytest.raises(ValueError, match="between 2 or more ranks"):
        links.measure(1, "cpu")


@pytest.mark.parametrize("gpu,n", [("h100", 2), ("h100", 4), ("a10", 4)])
def test_the_reported_assumption_is_what_the_cost_model_charges(gpu, n):
    a = assumptions()
    got = links.assumed(gpu, n, a)
    m = load_model("gpt2-345m")
    cm = CostModel(m, a)
    node = (load_cluster(f"{gpu}:{n}x1").node_types[0],)
    # a data-parallel plan's gradient all-reduce over the n GPUs runs at the reported ring bandwidth and latency
    dims = ParallelDims(dp=n)
    ctx = PlanContext(cm, stage_envs(node, dims, a), PlanConfig(dims, 1))
    mem = ctx.stages[0].mem
    params = m.layers * mem.layer_params + mem.fixed_params
    assert ctx.tails((m.layers,))[0][0] == pytest.approx(
        costs.ring_allreduce(params * a.grad_bytes, n, got["allreduce_bus_bw"], got["allreduce_step_latency_s"]), rel=1e-12)
    # a pipeline's activation send to the next stage at the reported link bandwidth and latency
    dims = ParallelDims(pp=n)
    ctx = PlanContext(cm, stage_envs(node, dims, a), PlanConfig(dims, 2))
    activation = m.bytes_per_elem * 2 * m.seq_len * m.hidden
    assert ctx.stages[0].send_next == pytest.approx(costs.send_time(activation, got["p2p_bw"], a), rel=1e-12)
    assert got["p2p_latency_s"] == a.p2p_latency_s
