"""``computron bench plan-accuracy`` machinery on the CPU: measured rows, the planner's predictions,
errors and summary consistent with them, JSON and PNG written (the numbers mean something on a GPU only)."""

import json

import pytest

from computron.cli import main
from computron.train.accuracy import Config, spearman


def test_plan_accuracy_writes_rows_summary_and_png(tmp_path, capsys):
    out = tmp_path / "acc"
    assert main(["bench", "plan-accuracy", "--device", "cpu", "--gpu", "a100-80gb", "--config", "tiny-gpt2:2:4:16",
                 "--config", "tiny-llama:2:4:16:full", "--config", "tiny-gpt2:2:4:16@pp=2",
                 "--warmup", "0", "--steps", "1", "--out", str(out)]) == 0
    data = json.loads((tmp_path / "acc.json").read_text())
    rows, s = data["rows"], data["summary"]
    assert [(r["model"], r["recompute"], r["pp"]) for r in rows] == [("tiny-gpt2", False, 1), ("tiny-llama", True, 1),
                                                                     ("tiny-gpt2", False, 2)]
    # the two-stage layout ran as two processes and was predicted as two stages: less memory per GPU
    assert rows[2]["predicted_bytes"] < rows[0]["predicted_bytes"]
    for r in rows:
        assert r["measured_s"] > 0 and r["predicted_s"] > 0 and r["measured_bytes"] > 0 and r["predicted_bytes"] > 0
        assert r["time_error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
        assert r["memory_error"] == pytest.approx(r["predicted_bytes"] / r["measured_bytes"] - 1)
    assert s["time_mean_abs_error"] == pytest.approx(sum(abs(r["time_error"]) for r in rows) / 3)
    assert s["time_worst_abs_error"] == pytest.approx(max(abs(r["time_error"]) for r in rows))
    assert (tmp_path / "acc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "3 configurations: time error" in capsys.readouterr().out


def test_plan_accuracy_profiles_the_trainers_layer_first(tmp_path):
    out = tmp_path / "acc"
    assert main(["bench", "plan-accuracy", "--device", "cpu", "--gpu", "a100-80gb", "--profile", "auto",
                 "--config", "tiny-llama:1:4:16", "--config", "tiny-llama:2:4:16", "--config", "tiny-llama:2:4:32",
                 "--warmup", "0", "--steps", "1", "--out", str(out)]) == 0
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
    assert not (tmp_path / "acc.json").exists()
