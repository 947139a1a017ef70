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
