"""The planner's pick in ``bench plan-accuracy``: groups, the picks to add to a run, ratios to the
fastest measured layout and the within-5% verdict (made-up rows), and the search behind the pick
(``plan search`` with the Trainer's restrictions, mapped as ``plan launch`` maps a plan)."""

import json

import pytest

from computron.planner.cli import main as plan_main
from computron.train.accuracy import Config, cost_model, shape_of
from computron.train.pick import TOLERANCE, compare, search_pick, to_measure


def row(text: str, seconds: float, added: bool = False) -> dict:
    c = Config.parse(text)
    return {"config": c.label, **c.as_row(), "measured_s": seconds, **({"added": "pick"} if added else {})}


def pick(text: str, predicted: float = 0.1) -> dict:
    return {"config": Config.parse(text), "predicted_s": predicted}


GIVEN = ["gpt2:4:32:1024@tp=2", "gpt2:4:32:1024@pp=2", "gpt2:8:32:1024@dp=2",  # gpt2 on 2 GPUs
         "gpt2-medium:4:32:1024@pp=2", "gpt2-medium:4:32:1024@pp=2,v=2",  # gpt2-medium on 2 GPUs
         "gpt2-large:4:32:1024@tp=4", "gpt2-large:4:32:1024@tp=2,dp=2",  # gpt2-large on 4 GPUs
         "gpt2-large:4:32:1024@tp=2",  # the same model and batch on 2 GPUs: a group of its own
         "gpt2-xl:2:16:1024@pp=2", "opt-2.7b:2:16:1024@tp=2"]
PICKS = {("gpt2", 32, 1024, 2): pick("gpt2:16:32:1024@dp=2,zero1"),  # not measured: added, the fastest
         ("gpt2-medium", 32, 1024, 2): pick("gpt2-medium:4:32:1024@pp=2"),  # measured, 10% slower than the fastest
         ("gpt2-large", 32, 1024, 4): pick("gpt2-large:4:32:1024@tp=2,dp=2"),  # measured, 4% slower: within
         ("gpt2-large", 32, 1024, 2): pick("gpt2-large:4:32:1024@tp=2"),  # the group's only layout
         ("gpt2-xl", 16, 1024, 2): pick("gpt2-xl:8:16:1024@dp=2,zero1"),  # added, but it failed to run
         ("opt-2.7b", 16, 1024, 2): {"error": "the search found no feasible plan on 2 h100"}}


def test_picks_not_measured_are_added_once_and_only_they():
    given = [Config.parse(c) for c in GIVEN]
    assert to_measure(given, PICKS) == [Config.parse("gpt2:16:32:1024@dp=2,zero1"), Config.parse("gpt2-xl:8:16:1024@dp=2,zero1")]
    # the same layout picked in another group (other GPU count or batch) is not the measured one
    assert to_measure(given, {("gpt2-large", 32, 1024, 4): pick("gpt2-large:4:32:1024@tp=4"),
                              ("gpt2-large", 64, 1024, 4): pick("gpt2-large:4:64:1024@tp=4")}) == \
        [Config.parse("gpt2-large:4:64:1024@tp=4")]
    # a partition is part of the layout: the uniform one written out is the measured one, another is not
    uniform = Config.parse("gpt2-medium:4:32:1024@pp=2,part=12/12").canonical(24)
    assert uniform == Config.parse("gpt2-medium:4:32:1024@pp=2")
    key = ("gpt2-medium", 32, 1024, 2)
    assert to_measure(given, {key: {"config": uniform, "predicted_s": 1.0}}) == []
    skewed = Config.parse("gpt2-medium:4:32:1024@pp=2,part=13/11").canonical(24)
    assert to_measure(given, {key: {"config": skewed, "predicted_s": 1.0}}) == [skewed]


def test_each_group_compares_its_pick_with_its_fastest_measured_layout():
    rows = [row("gpt2:4:32:1024@tp=2", 1.00), row("gpt2:4:32:1024@pp=2", 1.20), row("gpt2:8:32:1024@dp=2", 0.98),
            row("gpt2:16:32:1024@dp=2,zero1", 0.96, added=True),
            row("gpt2-medium:4:32:1024@pp=2", 1.10), row("gpt2-medium:4:32:1024@pp=2,v=2", 1.00),
            row("gpt2-large:4:32:1024@tp=4", 2.00), row("gpt2-large:4:32:1024@tp=2,dp=2", 2.08),
            row("gpt2-large:4:32:1024@tp=2", 3.0), row("gpt2-xl:2:16:1024@pp=2", 1.5), row("opt-2.7b:2:16:1024@tp=2", 2.5)]
    failed = {Config.parse("gpt2-xl:8:16:1024@dp=2,zero1").label: "the pick failed to run: rank 1 of 2 failed: OOM"}
    out = compare(rows, PICKS, failed)
    g = {x["group"]: x for x in out["groups"]}
    assert list(g) == ["gpt2 gb=32 s=1024 on 2 GPUs", "gpt2-medium gb=32 s=1024 on 2 GPUs",
                       "gpt2-large gb=32 s=1024 on 4 GPUs", "gpt2-large gb=32 s=1024 on 2 GPUs",
                       "gpt2-xl gb=16 s=1024 on 2 GPUs", "opt-2.7b gb=16 s=1024 on 2 GPUs"]
    a = g["gpt2 gb=32 s=1024 on 2 GPUs"]  # the added pick is the fastest of its group
    assert (a["measured"], a["pick_s"], a["fastest_s"], a["ratio"], a["within"], a["pick_added"]) == \
        (4, 0.96, 0.96, 1.0, True, True)
    assert a["fastest"] == a["pick"] == "gpt2 mbs=16 gb=32 s=1024 tp1 pp1 dp2 zero1"
    assert a["pick_layout"]["zero1"] and a["pick_predicted_s"] == 0.1
    b = g["gpt2-medium gb=32 s=1024 on 2 GPUs"]  # measured among the given, 10% slower: fails the 5%
    assert b["fastest"] == "gpt2-medium mbs=4 gb=32 s=1024 tp1 pp2 dp1 v2"
    assert b["ratio"] == pytest.approx(1.10) and not b["within"] and not b["pick_added"]
    c = g["gpt2-large gb=32 s=1024 on 4 GPUs"]
    assert c["ratio"] == pytest.approx(1.04) and c["within"]
    assert g["gpt2-large gb=32 s=1024 on 2 GPUs"]["ratio"] == 1.0  # not mixed with the 4-GPU group
    d = g["gpt2-xl gb=16 s=1024 on 2 GPUs"]  # a pick that failed to run has no ratio and fails
    assert d["pick"] == "gpt2-xl mbs=8 gb=16 s=1024 tp1 pp1 dp2 zero1" and d["ratio"] is None and not d["within"]
    assert d["note"].startswith("the pick failed to run: rank 1 of 2 failed")
    e = g["opt-2.7b gb=16 s=1024 on 2 GPUs"]
    assert e["pick"] is None and not e["within"] and e["note"] == "the search found no feasible plan on 2 h100"
    s = out["summary"]
    assert (s["groups"], s["tolerance"], s["all_within"]) == (6, TOLERANCE, False)
    assert s["worst_ratio"] == pytest.approx(1.10) and s["worst_group"] == "gpt2-medium gb=32 s=1024 on 2 GPUs"
    assert any("ZeRO-1" in x for x in s["restrictions"])
    # every group's pick measured and within 5%: the verdict passes
    ok = compare(rows[:4] + rows[6:9], PICKS)
    assert ok["summary"]["all_within"] and ok["summary"]["worst_ratio"] == pytest.approx(1.04)
    # a pick not measured and not said to have failed
    assert compare(rows[4:6], {("gpt2-medium", 32, 1024, 2): pick("gpt2-medium:8:32:1024@dp=2,zero1")}
                   )["groups"][0]["note"] == "the pick was not measured"


def test_the_pick_is_plan_searchs_best_within_the_trainers_options(tmp_path):
    from computron.models import resolve_model

    shape = shape_of(resolve_model("gpt2-medium", dtype="float32")[0], 1024, 32)
    (tmp_path / "m.json").write_text(json.dumps(shape.to_dict()))
    assert plan_main(["search", "--model", str(tmp_path / "m.json"), "--cluster", "h100:4x1", "--all-nodes", "--top", "1",
                      "--no-sequence-parallel", "--zero", "0,1", "--cp", "1", "--virtual-stages", "1,2",
                      "--bytes-per-param", "18", "--json", str(tmp_path / "plan.json")]) == 0
    best = json.loads((tmp_path / "plan.json").read_text())["plans"][0]
    got = search_pick("gpt2-medium", shape, 4, "h100", cost_model(shape, "h100", None))
    c = got["config"]
    assert (c.model, c.global_batch, c.seq_len, c.world) == ("gpt2-medium", 32, 1024, 4)
    assert (c.tp, c.pp, c.dp, c.mbs, c.v, c.zero1, c.recompute) == \
        (best["tp"], best["pp"], best["dp"], best["mbs"], best["virtual_stages"], best["zero1"], best["recompute"] == "full")
    assert got["predicted_s"] == pytest.approx(best["iteration_s"], rel=1e-5)
    # nothing the Trainer runs fits: said, not raised
    big = shape_of(resolve_model("llama-2-70b", dtype="float32")[0], 1024, 8)
    assert search_pick("llama-2-70b", big, 2, "a10", cost_model(big, "a10", None)) == \
        {"error": "the search found no feasible plan on 2 a10"}
