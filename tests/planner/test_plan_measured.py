"""Profile tables: lookup, interpolation, shape checks (no torch needed)."""

import pytest

from computron.planner.estimate import CostModel
from computron.planner.hardware import GPU_TYPES
from computron.planner.measured import load_profile, model_shape, table_from_dict
from computron.planner.model import TransformerShape

M = TransformerShape("m", "gpt", layers=4, hidden=64, heads=4, ffn=256, vocab=256, seq_len=32, global_batch=16)


def table():
    return table_from_dict({"gpu": "a100-80gb", "model": model_shape(M), "entries": [
        {"tp": 1, "mbs": 1, "fwd_s": 1.0, "bwd_s": 2.0, "act_bytes": 100},
        {"tp": 1, "mbs": 4, "fwd_s": 4.0, "bwd_s": 8.0, "act_bytes": 400}]})


def test_lookup_exact_interpolated_and_scaled():
    t = table()
    assert t.lookup("a100-80gb", 1, 1) == (1.0, 2.0, 100)
    assert t.lookup("a100-80gb", 1, 2) == pytest.approx((2.0, 4.0, 200))
    assert t.lookup("a100-80gb", 1, 8) == pytest.approx((8.0, 16.0, 800))
    assert t.lookup("a100-80gb", 2, 1) is None and t.lookup("v100", 1, 1) is None


def test_cost_model_uses_profile_then_roofline():
    cm = CostModel(M, profile=table())
    assert cm.layer(GPU_TYPES["a100-80gb"], 1, 4)[:2] == (4.0, 8.0)
    assert cm.source(GPU_TYPES["a100-80gb"], 1) == "profile"
    assert cm.source(GPU_TYPES["v100"], 1) == "roofline"
    assert cm.layer(GPU_TYPES["v100"], 1, 4)[0] < 1.0


def test_a_layer_outside_the_profiled_sizes_scales_as_the_roofline():
    """Sizes 1 and 4 profiled: 2 is interpolated; 8 is size 4's figures times the roofline's ratio of
    8 to 4, not twice them (a larger micro-batch uses the GPU better; the roofline's ratios matched the
    profiles' graph replays on two H200s within 3.5%); its activations still double."""
    from computron.planner import costs

    cm, gpu = CostModel(M, profile=table()), GPU_TYPES["a100-80gb"]
    assert cm.layer(gpu, 1, 2) == pytest.approx((2.0, 4.0, 200))
    roof = {b: sum(costs.compute_from_parts(cm.parts(gpu, 1, b))) for b in (4, 8)}
    k = roof[8] / roof[4]
    assert 1.0 < k < 2.0
    assert cm.layer(gpu, 1, 8) == pytest.approx((4.0 * k, 8.0 * k, 800))
    # below the smallest size: the same rule from size 1 (here no smaller size exists to check it on,
    # so a table profiled at 4 alone)
    only4 = table_from_dict({"gpu": "a100-80gb", "model": model_shape(M), "entries": [
        {"tp": 1, "mbs": 4, "fwd_s": 4.0, "bwd_s": 8.0, "act_bytes": 400}]})
    roof1 = sum(costs.compute_from_parts(cm.parts(gpu, 1, 1)))
    assert CostModel(M, profile=only4).layer(gpu, 1, 1) == pytest.approx((4.0 * roof1 / roof[4], 8.0 * roof1 / roof[4],
                                                                           100))


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="hidden=64"):
        CostModel(TransformerShape("n", "gpt", 4, 128, 4, 512, 256, 32, 16), profile=table())
    with pytest.raises(ValueError, match="not a planner profile"):
        table_from_dict({"x": 1})


def test_a_profile_from_before_the_activation_was_recorded_is_used():
    """Old files carry no ``activation`` or ``pre_norm``: they load and stand for any activation (the
    committed OPT profiles measured the GeLU layer); a new file is checked on both."""
    old = {k: v for k, v in model_shape(M).items() if k not in ("activation", "pre_norm")}
    entries = [{"tp": 1, "mbs": 1, "fwd_s": 1.0, "bwd_s": 2.0, "act_bytes": 100}]
    opt = TransformerShape("o", "gpt", 4, 64, 4, 256, 256, 32, 16, activation="relu")
    cm = CostModel(opt, profile=table_from_dict({"gpu": "a100-80gb", "model": old, "entries": entries}))
    assert cm.layer(GPU_TYPES["a100-80gb"], 1, 1) == (1.0, 2.0, 100)
    with pytest.raises(ValueError, match="activation='gelu_new'"):
        CostModel(opt, profile=table_from_dict({"gpu": "a100-80gb", "model": model_shape(M), "entries": entries}))


def test_the_committed_opt_profile_still_loads():
    import os

    from computron.models.presets import get_preset
    from computron.train.accuracy import shape_of

    path = os.path.join(os.path.dirname(__file__), "../../bench/results/plan_accuracy_h200_x4_profiles",
                        "plan_accuracy_h200_x4_two_profile_opt-2.7b_s1024.json")
    prof = load_profile(path)
    assert "activation" not in prof.shape
    cm = CostModel(shape_of(get_preset("opt-2.7b"), 1024, 8), profile=prof)
    assert cm.layer(GPU_TYPES["h200"], 1, 2) == prof.lookup("h200", 1, 2)


def paired_table(step: bool = True):
    """A layer of 1 ms forward, 2 ms backward (4 and 8 at mbs 4), 2.4 ms as a step; recomputed 1.5 ms
    and 3.5 ms, 4 ms as a step; ``step=False``: the same entries as a profile made before ``step_s``."""
    entries = [{"tp": 1, "mbs": 1, "fwd_s": 1.0e-3, "bwd_s": 2.0e-3, "act_bytes": 100, "step_s": 2.4e-3},
               {"tp": 1, "mbs": 4, "fwd_s": 4.0e-3, "bwd_s": 8.0e-3, "act_bytes": 400, "step_s": 9.0e-3},
               {"tp": 1, "part": "recompute", "mbs": 1, "fwd_s": 1.5e-3, "bwd_s": 3.5e-3, "step_s": 4.0e-3}]
    if not step:
        for e in entries:
            del e["step_s"]
    return table_from_dict({"gpu": "h200", "model": model_shape(M), "entries": entries})


def test_paired_steps_split_the_step_time_as_the_separate_timings_split():
    from computron.planner.costs import Assumptions
    from computron.planner.hardware import NodeType

    gpu = GPU_TYPES["h200"]
    node = NodeType("n", gpu, 1, 1, 450e9, 50e9, 1.0)
    on = CostModel(M, Assumptions(paired_steps=True), paired_table())
    # 2.4 ms split 1:2 -> 0.8 ms forward, 1.6 ms backward
    assert on.layer(gpu, 1, 1)[:2] == pytest.approx((0.8e-3, 1.6e-3), rel=1e-12)
    # interpolated at mbs 2: 2 + 4 ms separately, 2.4 + (9 - 2.4) / 3 = 4.6 ms as a step
    assert on.layer(gpu, 1, 2)[:2] == pytest.approx((4.6e-3 / 3, 2 * 4.6e-3 / 3), rel=1e-12)
    # recomputed: 4 ms split 1.5:3.5 -> (1.2, 2.8) ms, less the plain layer's paired (0.8, 1.6)
    assert on.recomputed(gpu, 1, 1, 1, fwd=123.0) == pytest.approx((0.4e-3, 1.2e-3), rel=1e-12)
    f, b, ftp, btp, again, _ = on.ops(node, 1, 1, False, "full")
    assert (ftp, btp) == (0.0, 0.0)
    assert (f, b, again) == pytest.approx((1.2e-3, 1.6e-3, 1.2e-3), rel=1e-12)  # forward + backward + again = 4 ms
    # off (the default), or a profile without step_s: the separate timings, exactly
    for cm in (CostModel(M, profile=paired_table()), CostModel(M, Assumptions(paired_steps=True), paired_table(False))):
        assert cm.layer(gpu, 1, 1) == (1.0e-3, 2.0e-3, 100)
        assert cm.recomputed(gpu, 1, 1, 1, fwd=123.0) == (max(1.5e-3 - 1.0e-3, 0.0), max(3.5e-3 - 2.0e-3, 0.0))
    assert not paired_table(False).steps and paired_table().lookup_step("layer", "h200", 1, 4) == 9.0e-3


def test_a_size_without_step_s_keeps_its_separate_timings():
    """A profile whose entries mix sizes with and without ``step_s`` never interpolates over the
    missing one: sizes next to it keep their separate timings."""
    from computron.planner.costs import Assumptions

    t = table_from_dict({"gpu": "h200", "entries": [
        {"tp": 1, "mbs": 1, "fwd_s": 1.0, "bwd_s": 2.0, "step_s": 2.4},
        {"tp": 1, "mbs": 4, "fwd_s": 4.0, "bwd_s": 8.0}]})
    assert t.lookup_step("layer", "h200", 1, 1) == 2.4
    assert t.lookup_step("layer", "h200", 1, 2) is None and t.lookup_step("layer", "h200", 1, 8) is None
    cm = CostModel(M, Assumptions(paired_steps=True), t)
    assert cm.layer(GPU_TYPES["h200"], 1, 2)[:2] == pytest.approx((2.0, 4.0))
    assert cm.layer(GPU_TYPES["h200"], 1, 2)[:2] == CostModel(M, profile=t).layer(GPU_TYPES["h200"], 1, 2)[:2]


def test_a_graphed_layer_is_its_graph_time_split_as_the_separate_timings_split():
    """``graph_s`` (the forward and backward replayed as one CUDA graph) stands for the layer where the
    micro-batch runs graphed, whatever ``paired_steps`` says; elsewhere, and where a profile lacks
    it, the layer keeps its other timings."""
    from computron.planner.costs import Assumptions

    entries = [{"tp": 1, "mbs": 1, "fwd_s": 1.0e-3, "bwd_s": 2.0e-3, "act_bytes": 100, "step_s": 2.4e-3,
                "graph_s": 1.5e-3},
               {"tp": 1, "part": "recompute", "mbs": 1, "fwd_s": 1.5e-3, "bwd_s": 3.5e-3, "step_s": 4.0e-3,
                "graph_s": 2.5e-3}]
    t = table_from_dict({"gpu": "h200", "model": model_shape(M), "entries": entries})
    gpu = GPU_TYPES["h200"]
    assert t.lookup_step("layer", "h200", 1, 1, graphed=True) == 1.5e-3
    assert t.lookup_step("layer", "h200", 1, 1) == 2.4e-3
    for a in (Assumptions(), Assumptions(paired_steps=True)):
        cm = CostModel(M, a, t)
        assert cm.layer(gpu, 1, 1, graphed=True)[:2] == pytest.approx((0.5e-3, 1.0e-3), rel=1e-12)
        # recomputed: 2.5 ms split 1.5:3.5 -> (0.75, 1.75) ms, less the plain layer's graphed (0.5, 1.0)
        assert cm.recomputed(gpu, 1, 1, 1, 123.0, graphed=True) == pytest.approx((0.25e-3, 0.75e-3), rel=1e-12)
    assert CostModel(M, profile=t).layer(gpu, 1, 1) == (1.0e-3, 2.0e-3, 100)
    older = table_from_dict({"gpu": "h200", "model": model_shape(M), "entries": [
        {k: v for k, v in e.items() if k != "graph_s"} for e in entries]})
    assert not older.graphs and CostModel(M, profile=older).layer(gpu, 1, 1, graphed=True) == (1.0e-3, 2.0e-3, 100)
