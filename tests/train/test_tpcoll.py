"""The tensor-parallel per-collective cost measured over real process groups (gloo on the CPU here),
the sizes and shapes a run measures it at, and the predictions that use it."""

import math
from dataclasses import replace

import pytest

from computron.models import resolve_model
from computron.planner import costs
from computron.planner.hardware import load_cluster
from computron.train import tpcoll
from computron.train.accuracy import FITTED_TP_COLLECTIVE_S, Config, assumptions, predict, shape_of


def test_the_trainers_tp_layer_is_timed_in_a_group_of_two_and_alone():
    shape = shape_of(resolve_model("tiny-llama", dtype="float32")[0], 16, 1)
    got = tpcoll.measure(2, "cpu", "float32", [(shape, 2)], warmup=1, repeats=2, depth=2)
    assert (got["ranks"], got["backend"]) == (2, "gloo")
    (e,) = got["entries"]
    # 2 all-reduces forward (after attention and MLP) and 2 of their gradients backward, counted
    assert (e["model"], e["seq_len"], e["mbs"], e["depth"], e["allreduces_per_layer"]) == ("tiny-llama", 16, 2, 2, 4)
    assert e["bytes"] == 2 * 16 * shape.hidden * 4  # one float32 [mbs, seq, hidden] activation
    assert len(e["group_s_by_rank"]) == len(e["alone_s_by_rank"]) == 2
    for k in ("group_s", "alone_s"):
        assert math.isfinite(e[k]) and e[k] > 0 and e[k] == pytest.approx(sum(e[k + "_by_rank"]) / 2)
    assert e["per_collective_s"] == max(0.0, (e["group_s"] - e["alone_s"]) / 4)
    assert math.isfinite(e["per_collective_s"]) and e["per_collective_s"] >= 0
    # the planner's value is the cost beyond the ring time it already charges for the same message
    a = assumptions()
    d = tpcoll.derive(got, "h100", a)
    (f,) = d["entries"]
    bw = load_cluster("h100:2x1").node_types[0].intra_bw * a.intra_eff
    assert f["ring_s"] == costs.ring_allreduce(e["bytes"], 2, bw, a.intra_latency_s)
    assert d["tp_collective_s"] == f["tp_collective_s"] == max(0.0, e["per_collective_s"] - f["ring_s"])
    assert tpcoll.by_tp([d, {"ranks": 4, "error": "rank 1 of 4 failed"}]) == {2: d["tp_collective_s"]}
    with pytest.raises(ValueError, match="2 or more ranks"):
        tpcoll.measure(1, "cpu", "float32", [(shape, 2)])


def test_the_sizes_and_shapes_a_run_measures():
    configs = [Config.parse(c) for c in ("tiny-gpt2:2:4:16@tp=2", "tiny-gpt2:4:4:16@tp=2,dp=2",
                                         "tiny-gpt2:2:8:16@dp=4", "tiny-llama:1:4:32@pp=2")]
    models = {c.model: resolve_model(c.model, dtype="float32")[0] for c in configs}
    # the configurations' own tp sizes, at their shapes
    assert tpcoll.shapes_by_tp(configs, models, search=False) == {2: [("tiny-gpt2", 16, 2), ("tiny-gpt2", 16, 4)]}
    # with the search, every tp it may take on their GPUs; tp=4 (no configuration runs it) at the
    # shapes of the configurations whose GPUs and model allow it (tiny-llama's 2 K/V heads do not)
    assert tpcoll.shapes_by_tp(configs, models, search=True) == {
        2: [("tiny-gpt2", 16, 2), ("tiny-gpt2", 16, 4)], 4: [("tiny-gpt2", 16, 4), ("tiny-gpt2", 16, 2)]}


def test_a_tp_layout_is_predicted_with_the_measured_cost_of_its_tp_else_the_fitted_one():
    cfg = Config.parse("gpt2-medium:8:32:1024@tp=2")
    shape = shape_of(resolve_model(cfg.model, dtype="float32")[0], cfg.seq_len, cfg.global_batch)
    fitted, _ = predict(shape, "h200", cfg, None)
    measured, _ = predict(shape, "h200", cfg, None, assumptions({2: 500e-6}))
    # every all-reduce of the step pays the difference: 4 a layer, the embedding's and the loss's 3,
    # per micro-batch
    count = (cfg.global_batch // cfg.mbs) * (4 * shape.layers + 1 + 3)
    assert measured - fitted == pytest.approx(count * (500e-6 - FITTED_TP_COLLECTIVE_S), rel=1e-9)
    # a measurement of another tp size leaves this layout on the fitted constant
    assert predict(shape, "h200", cfg, None, assumptions({4: 500e-6}))[0] == fitted
    assert assumptions().tp_collective_at(2) == FITTED_TP_COLLECTIVE_S


def test_a_graphed_tp_layout_pays_the_graphed_cost_of_each_collective():
    cfg = Config.parse("gpt2-medium:8:32:1024@tp=2")
    shape = shape_of(resolve_model(cfg.model, dtype="float32")[0], cfg.seq_len, cfg.global_batch)
    eager, _ = predict(shape, "h200", cfg, None, assumptions({2: 500e-6}))
    graphed, _ = predict(shape, "h200", cfg, None, assumptions({2: 500e-6}, graphed={2: 30e-6}, graphs=True))
    count = (cfg.global_batch // cfg.mbs) * (4 * shape.layers + 1 + 3)
    assert eager - graphed == pytest.approx(count * (500e-6 - 30e-6), rel=1e-9)
    # graphed, a tp size not measured in graphs pays the ring alone
    ring, _ = predict(shape, "h200", cfg, None, assumptions({2: 500e-6}, graphs=True))
    assert eager - ring == pytest.approx(count * 500e-6, rel=1e-9)
    # the trainer graphs a pipeline's stages too: their collectives pay the graphed cost, and the stages
    # keep their graphs' pools (estimate.stage_memory)
    pp = Config.parse("gpt2-medium:8:32:1024@tp=2,pp=2")
    a = assumptions({2: 500e-6}, graphed={2: 30e-6})
    (t_graphed, m_graphed), (t_eager, m_eager) = (predict(shape, "h200", pp, None, b) for b in
                                                  (replace(a, graphed_steps=True), a))
    assert t_graphed < t_eager and m_graphed > m_eager


def test_the_graphed_cost_of_a_collective_is_what_it_adds_to_a_graph_beyond_the_ring():
    m = {"ranks": 2, "backend": "nccl", "entries": [
        {"bytes": 10 * 2**20, "per_collective_s": 300e-6, "per_collective_graph_s": 70e-6},
        {"bytes": 20 * 2**20, "per_collective_s": 150e-6, "per_collective_graph_s": 90e-6}]}
    a = assumptions()
    d = tpcoll.derive(m, "h200", a)
    rings = [e["ring_s"] for e in d["entries"]]
    assert [e["tp_collective_graphed_s"] for e in d["entries"]] == [70e-6 - rings[0], 90e-6 - rings[1]]
    assert d["tp_collective_graphed_s"] == pytest.approx((70e-6 - rings[0] + 90e-6 - rings[1]) / 2)
    assert tpcoll.by_tp([d], graphed=True) == {2: d["tp_collective_graphed_s"]}
    # a measurement without graphed timings (the CPU's, or one made before them) gives none
    eager = tpcoll.derive({**m, "entries": [{k: v for k, v in e.items() if "graph" not in k} for e in m["entries"]]},
                          "h200", a)
    assert "tp_collective_graphed_s" not in eager and tpcoll.by_tp([eager], graphed=True) == {}
    assert tpcoll.by_tp([eager]) == {2: eager["tp_collective_s"]}
