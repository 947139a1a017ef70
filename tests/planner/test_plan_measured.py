"""Profile tables: lookup, interpolation, shape checks (no torch needed)."""

import pytest

from computron.planner.estimate import CostModel
from computron.planner.hardware import GPU_TYPES
from computron.planner.measured import model_shape, table_from_dict
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
