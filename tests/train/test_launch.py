"""``computron plan launch``: a plan JSON runs as the same layout here, its launch files parse back
into the same layout, and what cannot run here is refused with the reason."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from computron.cli import main
from computron.planner.cli import main as plan_main
from computron.train.launch import emit, parse_emitted, read_plan

TINY = "family: gpt\nlayers: 2\nhidden: 64\nheads: 4\nffn: 256\nvocab: 512\nseq_len: 8\nglobal_batch: 8\n"


def _estimate(tmp_path, model, cluster, *extra):
    out = tmp_path / "plan.json"
    assert plan_main(["estimate", "--model", model, "--cluster", cluster, "--json", str(out), *extra]) in (0, 1)
    return out


def test_a_plan_runs_as_its_layout(tmp_path, capsys):
    (tmp_path / "tiny-gpt2.yaml").write_text(TINY)  # the planner's shape of the engine's tiny-gpt2 preset
    plan = _estimate(tmp_path, str(tmp_path / "tiny-gpt2.yaml"), "a100-80gb:2x1",
                     "--tp", "1", "--pp", "2", "--dp", "1", "--mbs", "2", "--partition", "1,1")
    run = tmp_path / "run.json"
    assert main(["plan", "launch", str(plan), "--device", "cpu", "--steps", "2", "--json", str(run)]) == 0
    data = json.loads(run.read_text())
    cfg = data["config"]
    assert [r["step"] for r in data["steps"]] == [1, 2]
    assert cfg["model"] == "tiny-gpt2" and cfg["dims"] == {"dp": 1, "tp": 1, "pp": 2}
    assert (cfg["micro_batch"], cfg["global_batch"], cfg["seq_len"], cfg["partition"]) == (2, 8, 8, [1, 1])
    assert "launching tiny-gpt2: dp=1 tp=1 pp=2 mbs=2" in capsys.readouterr().out


def test_emitted_launch_files_parse_back_into_the_plan(tmp_path):
    plan = _estimate(tmp_path, "gpt2", "a100-80gb:8x2", "--tp", "2", "--pp", "2", "--dp", "4", "--mbs", "2",
                     "--partition", "7,5", "--recompute", "full", "--zero1")
    lay = read_plan(plan)
    assert (lay.dp, lay.tp, lay.pp, lay.mbs, lay.partition, lay.nodes, lay.recompute, lay.zero1) == \
        (4, 2, 2, 2, (7, 5), 2, True, True)
    interleaved = replace(lay, partition=(6, 6), virtual_stages=2, recompute=False, zero1=False)
    for layout in (lay, interleaved):
        for kind in ("megatron", "torchrun", "slurm"):
            files = emit(layout, kind, None, steps=5)
            assert len(files) == (layout.nodes if kind == "torchrun" else 1)
            for name, text in files.items():
                assert parse_emitted(text, layout) == layout, (kind, name)
    assert "--node-rank 1" in emit(lay, "torchrun", None, 5)["torchrun_node1.sh"]


def test_what_cannot_run_is_refused_with_the_reason(tmp_path, capsys):
    two_nodes = _estimate(tmp_path, "gpt2", "a100-80gb:8x2", "--tp", "2", "--pp", "2", "--dp", "4", "--mbs", "2")
    assert main(["plan", "launch", str(two_nodes), "--device", "cpu"]) == 2
    assert "the plan spans 2 nodes (8 GPUs each)" in capsys.readouterr().err
    (tmp_path / "one").mkdir()
    eight = _estimate(tmp_path / "one", "gpt2", "a100-80gb:8x1", "--tp", "2", "--pp", "2", "--dp", "2", "--mbs", "2")
    import torch

    assert main(["plan", "launch", str(eight), "--device", "cuda"]) == 2
    assert f"the plan needs 8 GPUs (dp=2 tp=2 pp=2); this machine has {torch.cuda.device_count()}" in \
        capsys.readouterr().err
    assert main(["plan", "launch", str(eight), "--model", "tiny-opt", "--device", "cpu"]) == 2
    assert "model 'tiny-opt' is not the plan's shape: layers 2 (plan 12)" in capsys.readouterr().err
    uneven = replace(read_plan(eight), pp=4, dp=1, partition=(3, 4, 2, 3))
    with pytest.raises(ValueError, match=r"Megatron-LM cannot express the partition \[3, 4, 2, 3\]"):
        emit(uneven, "megatron", None, 5)


def test_a_plan_beyond_the_runtime_is_refused_with_the_reason(tmp_path, capsys):
    zero3 = _estimate(tmp_path, "gpt2", "a100-80gb:8x1", "--tp", "2", "--pp", "1", "--dp", "4", "--mbs", "2",
                      "--zero", "3")
    assert main(["plan", "launch", str(zero3), "--device", "cpu"]) == 2
    assert "uses ZeRO stage 3, which the training runtime and its launch files do not run" in capsys.readouterr().err
    (tmp_path / "cp").mkdir()
    (tmp_path / "flash.yaml").write_text(TINY + "flash_attention: true\n")
    cp = _estimate(tmp_path / "cp", str(tmp_path / "flash.yaml"), "a100-80gb:8x1", "--tp", "2", "--pp", "1",
                   "--dp", "2", "--cp", "2", "--mbs", "1")
    assert main(["plan", "launch", str(cp), "--emit", "megatron", "--device", "cpu"]) == 2
    assert "uses context parallelism cp=2" in capsys.readouterr().err
    (tmp_path / "sel").mkdir()
    selective = _estimate(tmp_path / "sel", "gpt2", "a100-80gb:8x1", "--tp", "2", "--pp", "1", "--dp", "4", "--mbs", "2",
                          "--recompute", "selective")
    assert main(["plan", "launch", str(selective), "--device", "cpu"]) == 2  # it used to run without recomputation
    assert "uses selective recomputation, which the training runtime" in capsys.readouterr().err
