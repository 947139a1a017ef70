"""Pareto front over cluster compositions."""

import os

import pytest

from computron.planner.model import TransformerShape
from computron.planner.pareto import (ParetoPoint, compositions_upto, dominates, parse_node_types, pareto_front,
                                      plot, sweep)
from computron.planner.search import SearchOptions

SMALL = TransformerShape("small", "gpt", layers=8, hidden=1024, heads=16, ffn=4096, vocab=32000, seq_len=1024, global_batch=32)


def test_compositions_upto():
    got = compositions_upto([3, 3], 3)
    assert len(got) == 9 and (0, 0) not in got and all(1 <= sum(k) <= 3 for k in got)
    assert compositions_upto([1, 5], 3) == [k for k in compositions_upto([1, 5], 3) if k[0] <= 1]


def test_front_has_no_dominated_point(tmp_path):
    types, caps = parse_node_types("a100-80gb,v100:8,a10:4x2")
    assert caps == [None, None, 2] and types[2].gpus_per_node == 4
    points = sweep(SMALL, types, caps, 3, SearchOptions())
    front = pareto_front(points)
    assert front
    for a in front:
        assert not any(dominates(b, a) for b in points if b.plan is not None)
    on = {id(p) for p in front}
    for p in points:  # everything off the front is dominated or duplicates a front point
        if p.plan is not None and id(p) not in on:
            assert any(dominates(f, p) or (f.tokens_per_s == p.tokens_per_s and f.usd_per_mtok == p.usd_per_mtok)
                       for f in front)
    path = tmp_path / "front.png"
    plot(points, front, str(path), "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 1000


def test_front_by_hand():
    class P:  # minimal stand-in for a plan
        def __init__(self, tps, usd):
            self.tokens_per_s, self.usd_per_mtok = tps, usd

    pts = [ParetoPoint({"a": i}, 8, 1.0, P(t, c)) for i, (t, c) in enumerate([(10, 5), (20, 4), (30, 6), (15, 7), (30, 5)])]
    front = pareto_front(pts)
    assert [(p.tokens_per_s, p.usd_per_mtok) for p in front] == [(20, 4), (30, 5)]


def test_bad_node_types():
    with pytest.raises(ValueError, match="malformed node type"):
        parse_node_types("a100-80gb:8y2")
    with pytest.raises(ValueError, match="known GPU types"):
        parse_node_types("b200")
