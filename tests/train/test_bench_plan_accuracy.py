"""``computron bench plan-accuracy`` machinery on the CPU: measured rows, the planner's predictions,
errors and summary consistent with them, the planner's pick against the fastest measured layout,
links measured against the planner's assumption, JSON and PNG written (the numbers mean something
on a GPU only), the tensor-parallel per-collective cost measured and used."""

import json
import math

import pytest

from computron.cli import main
from computron.train import links
from computron.train.accuracy import FITTED_TP_COLLECTIVE_S, Config, assumptions, spearman


def test_plan_accuracy_writes_rows_summary_and_png(tmp_path, capsys):
    out = tmp_path / "acc"  # the pick and the links have a test of their own below
    assert main(["bench", "plan-accuracy", "--device", "cpu", "--gpu", "a100-80gb", "--config", "tiny-gpt2:2:4:16",
                 "--config", "tiny-llama:2:4:16:full", "--config", "tiny-gpt2:2:4:16@pp=2",
                 "--warmup", "0", "--steps", "1", "--no-pick", "--no-links", "--out", str(out)]) == 0
    data = json.loads((tmp_path / "acc.json").read_text())
    rows, s = data["rows"], data["summary"]
    assert [(r["model"], r["recompute"], r["pp"]) for r in rows] == [("tiny-gpt2", False, 1), ("tiny-llama", True, 1),
                                                                     ("tiny-gpt2", False, 2)]
    # the two-stage layout ran as two processes and was predicted as two stages: less memory per GPU;
    # each stage's memory recorded, predicted and measured (its rank's peak), the largest the row's
    assert rows[2]["predicted_bytes"] < rows[0]["predicted_bytes"]
    piped = rows[2]
    assert len(piped["predicted_bytes_by_stage"]) == 2 == len(piped["measured_bytes_by_stage"])
    assert max(piped["predicted_bytes_by_stage"]) == piped["predicted_bytes"]
    assert piped["measured_bytes_by_stage"] == piped["peak_bytes_by_rank"]  # dp = tp = 1: a rank a stage
    assert max(piped["measured_bytes_by_stage"]) == piped["measured_bytes"]
    assert "predicted_bytes_by_stage" not in rows[0] and len(rows[0]["peak_bytes_by_rank"]) == 1
    for r in rows:
        assert r["measured_s"] > 0 and r["predicted_s"] > 0 and r["measured_bytes"] > 0 and r["predicted_bytes"] > 0
        assert r["time_error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
        assert r["memory_error"] == pytest.approx(r["predicted_bytes"] / r["measured_bytes"] - 1)
    assert s["time_mean_abs_error"] == pytest.approx(sum(abs(r["time_error"]) for r in rows) / 3)
    assert s["time_worst_abs_error"] == pytest.approx(max(abs(r["time_error"]) for r in rows))
    # one GPU and two: each count summarised on its own too
    assert {n: g["configs"] for n, g in s["by_gpus"].items()} == {"1": 2, "2": 1}
    assert s["by_gpus"]["2"]["time_worst_abs_error"] == pytest.approx(abs(rows[2]["time_error"]))
    assert "pick" not in data and "links" not in data
    assert (tmp_path / "acc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "3 configurations: time error" in capsys.readouterr().out


def test_a_configuration_that_fails_is_recorded_and_the_rest_still_measured(tmp_path, capsys, monkeypatch):
    from computron.train import accuracy
    from computron.train.dist import RankFailed

    real = accuracy.measure

    def measure(cfg, *a, **kw):
        if cfg.pp == 2:
            raise RankFailed("rank 1 of 2 failed: PipeliningShapeError: a stride mismatch")
        return real(cfg, *a, **kw)

    monkeypatch.setattr(accuracy, "measure", measure)
    args = ["bench", "plan-accuracy", "--device", "cpu", "--gpu", "a100-80gb", "--warmup", "0", "--steps", "1",
            "--no-pick", "--no-links", "--out", str(tmp_path / "acc")]
    assert main(args + ["--config", "tiny-gpt2:2:4:16@pp=2", "--config", "tiny-gpt2:2:4:16"]) == 1
    data = json.loads((tmp_path / "acc.json").read_text())
    assert [r["config"] for r in data["rows"]] == [Config.parse("tiny-gpt2:2:4:16").label]
    label = Config.parse("tiny-gpt2:2:4:16@pp=2").label
    assert data["failed"] == {label: "failed to run: rank 1 of 2 failed: PipeliningShapeError: a stride mismatch"}
    assert f"error: {label}: failed to run: rank 1 of 2" in capsys.readouterr().err
    # nothing ran: no result, an error naming why
    assert main(args + ["--config", "tiny-gpt2:2:4:16@pp=2", "--out", str(tmp_path / "none")]) == 1
    assert "error: no configuration ran: " + label in capsys.readouterr().err and not (tmp_path / "none.json").exists()


def test_plan_accuracy_on_two_ranks_reports_the_pick_and_the_links(tmp_path, capsys):
    given = ["tiny-gpt2:2:4:16@pp=2", "tiny-gpt2:2:4:16@dp=2,zero1"]
    assert main(["bench", "plan-accuracy", "--device", "cpu", "--gpu", "a100-80gb", "--config", given[0],
                 "--config", given[1], "--warmup", "0", "--steps", "1", "--link-sizes", "0.0625,0.25",
                 "--out", str(tmp_path / "acc")]) == 0
    data = json.loads((tmp_path / "acc.json").read_text())
    rows, pick = data["rows"], data["pick"]
    # one group (the same model, batch and sequence on 2 GPUs): the search's pick, measured here (one of
    # the given layouts, or added to the run), against the fastest layout measured
    (g,) = pick["groups"]
    assert (g["model"], g["global_batch"], g["seq_len"], g["gpus"], g["measured"]) == ("tiny-gpt2", 4, 16, 2, len(rows))
    (picked,) = [r for r in rows if r["config"] == g["pick"]]
    assert bool(picked.get("added")) == (picked["config"] not in [Config.parse(c).label for c in given])
    assert len(rows) == 2 + bool(picked.get("added"))
    assert picked["predicted_s"] == pytest.approx(g["pick_predicted_s"], rel=1e-9)  # the search's own estimate
    assert g["pick_s"] == picked["measured_s"] and g["fastest_s"] == min(r["measured_s"] for r in rows)
    assert g["ratio"] == pytest.approx(g["pick_s"] / g["fastest_s"]) and g["within"] == (g["ratio"] <= 1.05)
    s = pick["summary"]
    assert (s["groups"], s["worst_ratio"], s["all_within"]) == (1, g["ratio"], g["within"]) and s["restrictions"]
    # all-reduce and send/recv over the two gloo ranks, beside the bandwidths the planner assumes for an A100 node
    (link,) = data["links"]
    assert (link["ranks"], link["backend"]) == (2, "gloo")
    assert link["assumed"] == links.assumed("a100-80gb", 2, assumptions())
    assert [r["bytes"] for r in link["sizes"]] == [65536, 262144]
    for r in link["sizes"]:
        for k in ("allreduce_s", "allreduce_bus_bw", "p2p_s", "p2p_bw", "allreduce_assumed_bus_bw", "p2p_assumed_bw"):
            assert math.isfinite(r[k]) and r[k] > 0, k
    printed = capsys.readouterr().out
    assert "planner's pick against the fastest measured" in printed and f"ratio {g['ratio']:.3f}" in printed
    assert "links over 2 ranks (gloo) against the planner's a100-80gb node" in printed
    # the search may take tp=2 on 2 GPUs: the per-collective cost measured over 2 ranks at the given
    # shape, and used by every prediction of this run (the search's included)
    tp = data["tp_collective"]
    (group,) = tp["groups"]
    assert (group["ranks"], group["backend"], [(e["model"], e["mbs"]) for e in group["entries"]]) == \
        (2, "gloo", [("tiny-gpt2", 2)])
    assert tp["used"] == "measured" and tp["measured_by_tp"] == {"2": group["tp_collective_s"]}
    assert group["tp_collective_s"] >= 0 and tp["fallback_s"] == FITTED_TP_COLLECTIVE_S
    assert f"tp collective cost used: tp=2 {group['tp_collective_s'] * 1e6:.0f} us" in printed
    # predicted again without a device: the same measurements, the pick searched again, the links kept,
    # the per-collective cost derived again from the stored measurement
    assert main(["bench", "plan-accuracy", "--rescore", str(tmp_path / "acc.json"), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["pick"]["groups"][0]["pick"] == g["pick"] and again["pick"]["groups"][0]["ratio"] == g["ratio"]
    assert [r.get("added") for r in again["rows"]] == [r.get("added") for r in rows]
    assert again["links"] == data["links"] and again["tp_collective"] == tp
    # the pipeline's last stage keeps no outputs where torch lets the trainer say so, and the memory
    # model was told as much
    from computron.train.job import pipeline_keeps_outputs

    assert data["pipeline_keeps_outputs"] is pipeline_keeps_outputs() is False
    # a result from before the measurement is predicted with the fitted constant, and says so; one from
    # before the trainer turned the pipeline's outputs off is predicted as keeping them: its last
    # stage's peak is the larger
    del data["tp_collective"], data["pipeline_keeps_outputs"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert main(["bench", "plan-accuracy", "--rescore", str(tmp_path / "old.json"), "--out", str(tmp_path / "old2")]) == 0
    old = json.loads((tmp_path / "old2.json").read_text())
    assert (old["tp_collective"]["used"], old["tp_collective"]["measured_by_tp"], old["tp_collective"]["groups"]) == \
        ("fitted", {}, [])
    pp = [(a, b) for a, b in zip(again["rows"], old["rows"]) if a["config"] == Config.parse(given[0]).label]
    assert pp and all(b["predicted_bytes"] > a["predicted_bytes"] for a, b in pp) and old["pipeline_keeps_outputs"]


def test_plan_accuracy_profiles_the_trainers_layer_first(tmp_path):
    out = tmp_path / "acc"
    assert main(["bench", "plan-accuracy", "--device", "cpu", "--gpu", "a100-80gb", "--profile", "auto",
                 "--config", "tiny-llama:1:4:16", "--config", "tiny-llama:2:4:16", "--config", "tiny-llama:2:4:32",
                 "--warmup", "0", "--steps", "1", "--no-pick", "--out", str(out)]) == 0
    rows = json.loads((tmp_path / "acc.json").read_text())["rows"]
    # one profile per model and sequence length, measured at the micro-batches the configurations use
    prof = [json.loads((tmp_path / f"acc_profile_tiny-llama_s{s}.json").read_text()) for s in (16, 32)]
    assert [sorted(e["mbs"] for e in p["entries"] if e.get("part", "layer") == "layer") for p in prof] == [[1, 2], [2]]
    assert [sorted(e["mbs"] for e in p["entries"] if e.get("part") == "head") for p in prof] == [[1, 2], [2]]
    assert {p["layer"] for p in prof} == {"runtime"} and prof[1]["model"]["seq_len"] == 32
    assert [r["profile"] for r in rows] == [str(tmp_path / "acc_profile_tiny-llama_s16.json")] * 2 + \
        [str(tmp_path / "acc_profile_tiny-llama_s32.json")]
    for r in rows:  # predicted from the measured layer (a CPU's layer is far slower than the A100 roofline's)
        assert r["predicted_s"] > 2 * r["roofline_s"] > 0
    # a stored result predicted again (no device), its profiles found in another directory
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in tmp_path.glob("acc_profile_*.json"):
        f.rename(moved / f.name)
    assert main(["bench", "plan-accuracy", "--rescore", str(tmp_path / "acc.json"), "--profiles", str(moved),
                 "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["rescored"] and [r["measured_s"] for r in again["rows"]] == [r["measured_s"] for r in rows]
    assert [r["predicted_s"] for r in again["rows"]] == pytest.approx([r["predicted_s"] for r in rows], rel=1e-12)
    # the profiles timed each layer's forward and backward as a step too: each row's prediction from it
    assert all(r["paired_s"] > 0 and r["paired_error"] == r["paired_s"] / r["measured_s"] - 1 for r in rows)
    assert [r["paired_s"] for r in again["rows"]] == pytest.approx([r["paired_s"] for r in rows], rel=1e-12)
    assert [r["profile"] for r in again["rows"]] == [str(moved / "acc_profile_tiny-llama_s16.json")] * 2 + \
        [str(moved / "acc_profile_tiny-llama_s32.json")]


def test_configurations_and_rank_correlation():
    assert Config.parse("gpt2-xl:4:16:1024:full") == Config("gpt2-xl", 4, 16, 1024, True)
    with pytest.raises(ValueError, match="expected MODEL:MBS:GLOBAL_BATCH:SEQ_LEN"):
        Config.parse("gpt2:4:16")
    c = Config.parse("gpt2:2:32:1024@tp=2,pp=2,v=2,dp=2,zero1")
    assert (c.tp, c.pp, c.dp, c.v, c.zero1, c.world) == (2, 2, 2, 2, True, 8)
    assert c.label == "gpt2 mbs=2 gb=32 s=1024 tp2 pp2 dp2 v2 zero1"
    with pytest.raises(ValueError, match="'tp=0' is not tp=, pp=, dp=, v="):
        Config.parse("gpt2:2:32:1024@tp=0")
    c = Config.parse("gpt2:2:32:1024@pp=2,v=2,part=4/3/3/2")
    assert c.partition == (4, 3, 3, 2) and c.label.endswith("pp2 dp1 v2 part4/3/3/2")
    assert Config.from_row(c.as_row()) == c and c.canonical(12) == c
    assert Config.parse("gpt2:2:32:1024@pp=2,v=2,part=3/3/3/3").canonical(12).partition is None
    with pytest.raises(ValueError, match="part= needs pp\\*v = 4 layer counts, got 2"):
        Config.parse("gpt2:2:32:1024@pp=2,v=2,part=6/6")
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def test_bad_inputs_are_refused_before_any_measurement(tmp_path, capsys):
    out = str(tmp_path / "acc")
    assert main(["bench", "plan-accuracy", "--rescore", str(tmp_path / "none.json"), "--out", out]) == 2
    assert "none.json is not a readable plan-accuracy result" in capsys.readouterr().err
    (tmp_path / "other.json").write_text('{"rows": [{"model": "tiny-opt"}]}')
    assert main(["bench", "plan-accuracy", "--rescore", str(tmp_path / "other.json"), "--out", out]) == 2
    assert "other.json is not a readable plan-accuracy result (KeyError" in capsys.readouterr().err
    assert main(["bench", "plan-accuracy", "--device", "cpu", "--gpu", "a100-80gb", "--profile",
                 str(tmp_path / "missing.json"), "--config", "tiny-opt:1:2:8", "--out", out]) == 2
    assert "missing.json' does not exist" in capsys.readouterr().err
    assert main(["bench", "plan-accuracy", "--device", "cpu", "--gpu", "a200", "--config", "tiny-opt:1:2:8", "--out", out]) == 2
    assert "unknown GPU type 'a200'" in capsys.readouterr().err
    assert main(["bench", "plan-accuracy", "--device", "cpu", "--gpu", "a100-80gb", "--config", "tiny-gpt2:2:4:16@pp=2,part=1/2",
                 "--out", out]) == 2
    assert "the partition covers 3 layers, tiny-gpt2 has 2" in capsys.readouterr().err
    for layout, why in (("tp=3", "tp=3 does not divide the 4 attention heads"),
                        ("pp=2,v=2", "pp=2 x v=2 model chunks exceed the 2 layers")):
        assert main(["bench", "plan-accuracy", "--device", "cpu", "--gpu", "a100-80gb", "--config",
                     f"tiny-gpt2:2:4:16@{layout}", "--out", out]) == 2
        assert why in capsys.readouterr().err
    assert main(["bench", "plan-accuracy", "--device", "cpu", "--gpu", "a100-80gb", "--config", "tiny-opt:1:2:8",
                 "--cuda-graphs", "--out", out]) == 2
    assert "--cuda-graphs needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "acc.json").exists()


def test_paired_steps_leave_a_committed_rescore_as_it_was(tmp_path, monkeypatch, capsys):
    """The committed two-H200 result, rescored: its profiles predate ``step_s``, so turning
    ``paired_steps`` on changes no prediction (bit for bit) and adds no ``paired_s``; the same profiles
    given a ``step_s`` leave every default prediction as it was and add ``paired_s`` beside it."""
    import os
    from dataclasses import replace

    from computron.train import accuracy

    root = os.path.join(os.path.dirname(__file__), "../../bench/results")
    result = json.loads(open(os.path.join(root, "plan_accuracy_h200_x2_two.json")).read())
    profiles = os.path.join(root, "plan_accuracy_h200_x2_profiles")
    quiet = lambda s: None  # noqa: E731

    def preds(out):
        return [(r["predicted_s"], r["predicted_bytes"], r.get("roofline_s")) for r in out["rows"]]

    base = accuracy.rescore(result, profiles, quiet)
    assert not any("paired_s" in r for r in base["rows"]) and "paired_time_mean_abs_error" not in base["summary"]
    real = accuracy.assumptions
    monkeypatch.setattr(accuracy, "assumptions", lambda *a, **k: replace(real(*a, **k), paired_steps=True))
    on = accuracy.rescore(result, profiles, quiet)
    assert preds(on) == preds(base) and on["summary"] == base["summary"] and on["pick"] == base["pick"]
    monkeypatch.setattr(accuracy, "assumptions", real)
    # the same profiles as a run measuring step_s would write them: the step 0.8 of forward + backward
    stepped = tmp_path / "profiles"
    stepped.mkdir()
    for name in os.listdir(profiles):
        data = json.loads(open(os.path.join(profiles, name)).read())
        for e in data["entries"]:
            if e.get("part", "layer") in ("layer", "recompute"):
                e["step_s"] = 0.8 * (e["fwd_s"] + e["bwd_s"])
        (stepped / name).write_text(json.dumps(data))
    again = accuracy.rescore(result, str(stepped), quiet)
    assert preds(again) == preds(base) and again["pick"] == base["pick"]
    assert {k: v for k, v in again["summary"].items() if not k.startswith("paired_")} == base["summary"]
    assert all(0 < r["paired_s"] < r["predicted_s"] for r in again["rows"])
    assert again["summary"]["paired_time_mean_abs_error"] == \
        pytest.approx(sum(abs(r["paired_s"] / r["measured_s"] - 1) for r in again["rows"]) / len(again["rows"]))
    # the command prints both
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert main(["bench", "plan-accuracy", "--rescore", str(tmp_path / "r.json"), "--profiles", str(stepped),
                 "--out", str(tmp_path / "again")]) == 0
    assert "forward and backward timed as a step (paired_steps, paired_s): time error" in capsys.readouterr().out


def test_a_committed_graphed_run_rescores_to_its_own_predictions():
    """The two-H200 run with ``--cuda-graphs`` (layouts without a pipeline replayed as CUDA graphs),
    rescored from its committed profiles: its graphed rows at their profiles' ``graph_s`` and the
    graphed per-collective cost, its pipelines eager, every time as the run predicted it but for
    torch's ZeRO-1 (its traffic modelled since); its memory as the committed rescore has it (the graphs'
    pool: the graphed rows' memory higher, the pipelines' unchanged)."""
    import os

    from computron.train import accuracy

    root = os.path.join(os.path.dirname(__file__), "../../bench/results/plan_accuracy_h200_x2_graphs")
    result = json.loads(open(os.path.join(root, "plan_accuracy_h200_x2_two.json")).read())
    pooled = json.loads(open(os.path.join(root, "plan_accuracy_h200_x2_two_rescored.json")).read())
    again = accuracy.rescore(result, root, lambda s: None)
    profiled = {(f.split("_profile_")[1].rsplit("_s", 1)[0], e["tp"], e["mbs"]) for f in os.listdir(root)
                if "_profile_" in f for e in json.loads(open(os.path.join(root, f)).read())["entries"]
                if "part" not in e}
    for old, new, want in zip(result["rows"], again["rows"], pooled["rows"]):
        got, wanted = (new["predicted_s"], new["predicted_bytes"]), (want["predicted_s"], want["predicted_bytes"])
        if (old["model"], old["tp"], old["mbs"]) not in profiled:  # picks above the sizes profiled, scaled
            assert old["added"] and new["predicted_s"] < want["predicted_s"], old["config"]  # as the roofline since
            continue
        assert got == wanted, old["config"]
        if not old["zero1"]:
            assert new["predicted_s"] == old["predicted_s"], old["config"]
        else:  # the broadcast of the fp32 masters, now charged
            assert new["predicted_s"] > old["predicted_s"], old["config"]
        assert new["cuda_graphs"] == (old["pp"] == 1)
        if new["cuda_graphs"]:
            assert new["predicted_bytes"] > old["predicted_bytes"] and abs(new["memory_error"]) < 0.07, old["config"]
        else:
            assert new["predicted_bytes"] == old["predicted_bytes"]
    # the picks searched again by the planner as it is now (which graphs pipelines too, unlike this run's
    # trainer): each group has one, and one the run did not measure says so
    assert [g["group"] for g in again["pick"]["groups"]] == [g["group"] for g in pooled["pick"]["groups"]]
    for g in again["pick"]["groups"]:
        assert g["pick_predicted_s"] > 0 and (g["pick_s"] is None) == (g.get("note") == "the pick was not measured")
    graphed = result["tp_collective"]["graphed_by_tp"]["2"]
    assert 0 < graphed < result["tp_collective"]["measured_by_tp"]["2"] / 4
    for r in again["rows"]:
        if r["tp"] > 1:
            eager_s = result["tp_collective"]["measured_by_tp"]["2"]
            assert r["tp_collective_s"] == (graphed if r["cuda_graphs"] else eager_s)
    # the same rows predicted eager are far off where the graphs took the host out of the step
    eager = accuracy.rescore({**result, "rows": [{**r, "cuda_graphs": False} for r in result["rows"]]}, root,
                             lambda s: None)
    worst = max(abs(r["time_error"]) for r in eager["rows"] if r["tp"] > 1)
    assert worst > 0.5 > max(abs(r["time_error"]) for r in again["rows"] if r["tp"] > 1)


def test_the_profile_for_the_pick_measures_smaller_micro_batches(tmp_path, monkeypatch):
    """With the pick's search coming, the profile covers every micro-batch size under the smallest
    configured that divides a configured global batch (the search may pick one, and a size under the
    smallest measured would be scaled in proportion, too fast); without it, the configured sizes only."""
    import computron.planner.profile as profile
    from computron.train.accuracy import profile_layers

    asked = []

    def fake(shape, tps, sizes, device, gpu, log=print):
        asked.append((tps, sizes))
        return {"dtype": "float32"}

    monkeypatch.setattr(profile, "run_profile", fake)
    configs = [Config.parse(c) for c in ("tiny-gpt2:4:12:16", "tiny-gpt2:8:16:16@pp=2")]
    profile_layers(configs, "h200", "cpu", "float32", str(tmp_path / "p"), log=lambda s: None, search_tps=True)
    profile_layers(configs, "h200", "cpu", "float32", str(tmp_path / "p"), log=lambda s: None)
    assert [sizes for _, sizes in asked] == [[1, 2, 3, 4, 8], [4, 8]]


def test_a_stages_measured_memory_is_the_largest_peak_of_its_ranks():
    """Ranks go stage by stage (``r = stage * dp*tp + d*tp + t``): with dp = tp = 2 and pp = 2, ranks
    0-3 are stage 0 and 4-7 stage 1."""
    from computron.models import resolve_model
    from computron.train.accuracy import score

    cfg = Config.parse("tiny-llama:2:8:16@tp=2,pp=2,dp=2")
    peaks = [5, 9, 7, 6, 3, 2, 8, 4]
    got = {"time_s": 0.1, "peak_bytes": max(peaks), "tflops_per_gpu": 1.0, "peak_bytes_by_rank": peaks}
    row = score(cfg, resolve_model("tiny-llama", dtype="float32")[0], got, "a100-80gb", None, lambda *_: None)
    assert row["measured_bytes_by_stage"] == [9, 8]
    assert len(row["predicted_bytes_by_stage"]) == 2 and max(row["predicted_bytes_by_stage"]) == row["predicted_bytes"]
