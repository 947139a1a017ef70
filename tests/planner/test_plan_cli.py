"""`computron plan ...` end to end, its wiring, and clear errors on bad input."""

import argparse
import csv
import json

import pytest

from computron.planner import cli

TINY = """\
name: tiny
family: gpt
layers: 4
hidden: 64
heads: 4
ffn: 256
vocab: 256
seq_len: 32
global_batch: 16
"""


def run(argv, capsys):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_search_writes_csv_and_json(tmp_path, capsys):
    c, j = tmp_path / "plans.csv", tmp_path / "plans.json"
    code, out, _ = run(["search", "--model", "gpt2-345m", "--cluster", "a100-80gb:8x1,v100:8x1", "--top", "3",
                        "--csv", str(c), "--json", str(j)], capsys)
    assert code == 0 and "best" in out
    rows = list(csv.DictReader(c.open()))
    assert len(rows) == 3 and {"compute_s", "bubble_s", "tp_s", "pp_s", "dp_s", "mem_per_stage_gib", "cost_per_iteration"} <= set(rows[0])
    data = json.loads(j.read_text())
    assert len(data["plans"]) == 3 and data["plans"][0]["rank"] == 1
    assert float(rows[0]["iteration_s"]) <= float(rows[1]["iteration_s"])


def test_search_recompute_selective_from_cli(tmp_path, capsys):
    c = tmp_path / "plans.csv"
    code, _, _ = run(["search", "--model", "gpt2-345m", "--cluster", "a100-80gb:8x1", "--top", "2", "--recompute",
                      "selective", "--csv", str(c)], capsys)
    rows = list(csv.DictReader(c.open()))
    assert code == 0 and len(rows) == 2 and {r["recompute"] for r in rows} == {"selective"}
    assert all(float(r["recompute_s"]) > 0 for r in rows)  # GPT-2 has no fused attention: the core runs again
def test_search_objectives_from_cli(tmp_path, capsys):
    code, out, _ = run(["search", "--model", "gpt2-345m", "--cluster", "a100-80gb:8x2,v100:8x2", "--objective",
                        "throughput", "--cost-limit", "50", "--top", "2"], capsys)
    assert code == 0
    code, _, err = run(["search", "--model", "gpt2-345m", "--cluster", "a100-80gb:8x1", "--objective", "cost",
                        "--time-limit", "0.000001"], capsys)
    assert code == 1 and "no feasible plan" in err


def test_estimate_prints_breakdown_and_memory(tmp_path, capsys):
    j = tmp_path / "one.json"
    code, out, _ = run(["estimate", "--model", "gpt3-175b", "--cluster", "a100-80gb:8x8", "--tp", "8", "--pp", "8",
                        "--dp", "1", "--mbs", "1", "--global-batch", "64", "--recompute", "full", "--json", str(j)], capsys)
    assert code == 0 and "bubble" in out and "memory GiB" in out
    data = json.loads(j.read_text())
    assert data["tp"] == 8 and data["partition"] == "12/12/12/12/12/12/12/12" and data["feasible"]
    # without recomputation it does not fit: reported, exit code 1
    code, out, err = run(["estimate", "--model", "gpt3-175b", "--cluster", "a100-80gb:8x8", "--tp", "8", "--pp", "8",
                          "--dp", "1", "--mbs", "1", "--global-batch", "64", "--partition", "balanced"], capsys)
    assert code == 1 and "NOT fit" in err and "NO" in out


def test_estimate_explicit_partition_and_placement(capsys):
    code, out, _ = run(["estimate", "--model", "gpt2-1.5b", "--cluster", "a100-80gb:8x2,v100:8x2", "--tp", "1",
                        "--pp", "4", "--dp", "8", "--mbs", "2", "--partition", "18,7,7,16",
                        "--placement", "a100-80gb,v100*2,a100-80gb"], capsys)
    assert code == 0 and "[18, 7, 7, 16]" in out
    code, _, err = run(["estimate", "--model", "gpt2-1.5b", "--cluster", "a100-80gb:8x2,v100:8x2", "--tp", "1",
                        "--pp", "4", "--dp", "8", "--mbs", "2", "--partition", "10,10,10"], capsys)
    assert code == 2 and "pp=4 entries" in err


def test_pareto_writes_png_csv_json(tmp_path, capsys):
    png, c, j = tmp_path / "p.png", tmp_path / "p.csv", tmp_path / "p.json"
    code, out, _ = run(["pareto", "--model", "gpt2-345m", "--node-types", "a100-80gb,v100", "--max-nodes", "2",
                        "--png", str(png), "--csv", str(c), "--json", str(j)], capsys)
    assert code == 0 and "Pareto front" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    rows = list(csv.DictReader(c.open()))
    assert len(rows) == 5 and any(r["pareto"] == "True" for r in rows)
    assert len(json.loads(j.read_text())["points"]) == 5


def test_profile_on_cpu_feeds_estimate_and_search(tmp_path, capsys):
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY)
    prof = tmp_path / "prof.json"
    code, out, _ = run(["profile", "--model", str(model), "--tp", "1,2", "--mbs", "1,2", "--device", "cpu",
                        "--warmup", "1", "--repeats", "2", "--out", str(prof)], capsys)
    assert code == 0
    data = json.loads(prof.read_text())
    assert data["gpu"] == "cpu" and len(data["entries"]) == 4
    assert all(e["fwd_s"] > 0 and e["bwd_s"] > 0 and e["act_bytes"] > 0 for e in data["entries"])
    j = tmp_path / "est.json"
    code, out, _ = run(["estimate", "--model", str(model), "--cluster", "a100-80gb:8x1", "--tp", "2", "--pp", "2",
                        "--dp", "2", "--mbs", "2", "--profile", str(prof), "--profile-gpu", "a100-80gb",
                        "--json", str(j)], capsys)
    assert code == 0 and json.loads(j.read_text())["cost_source"] == "profile"
    code, out, _ = run(["search", "--model", str(model), "--cluster", "a100-80gb:8x1", "--tp", "1,2", "--top", "2",
                        "--profile", str(prof), "--profile-gpu", "a100-80gb"], capsys)
    assert code == 0
    # a profile of another shape is refused
    code, _, err = run(["estimate", "--model", str(model), "--cluster", "a100-80gb:8x1", "--tp", "2", "--pp", "2",
                        "--dp", "2", "--mbs", "2", "--seq-len", "64", "--profile", str(prof)], capsys)
    assert code == 2 and "seq_len" in err
    # a tp that does not split the heads is refused, not profiled as a smaller shard
    code, _, err = run(["profile", "--model", str(model), "--tp", "3", "--device", "cpu", "--out",
                        str(tmp_path / "x.json")], capsys)
    assert code == 2 and "tp=3 does not divide" in err and not (tmp_path / "x.json").exists()


def test_add_parser_wires_into_a_top_level_cli(capsys):
    top = argparse.ArgumentParser(prog="computron")
    sub = top.add_subparsers(dest="command")
    cli.add_parser(sub)
    args = top.parse_args(["plan", "estimate", "--model", "gpt2-345m", "--cluster", "a100-80gb:8x1", "--tp", "1",
                           "--pp", "1", "--dp", "8", "--mbs", "4"])
    assert args.func(args) == 0
    args = top.parse_args(["plan", "estimate", "--model", "gpt2-345m", "--cluster", "b100:8x1", "--tp", "1",
                           "--pp", "1", "--dp", "8", "--mbs", "4"])
    assert args.func(args) == 2
    args = top.parse_args(["plan"])
    assert args.func(args) == 2


@pytest.mark.parametrize("argv,needle", [
    (["search", "--model", "gpt2-345m", "--cluster", "b200:8x2"], "known GPU types: a10, a100-40gb, a100-80gb, h100, h200, l4, v100"),
    (["search", "--model", "gpt2-345m", "--cluster", "a100-80gb:8"], "malformed node spec 'a100-80gb:8'"),
    (["search", "--model", "gpt2-345m", "--cluster", "a100-80gb8x2"], "missing ':GPUSxNODES'"),
    (["search", "--model", "gpt2-345m", "--cluster", "a100-80gb:8x0"], "at least 1"),
    (["search", "--model", "gpt-9", "--cluster", "a100-80gb:8x1"], "unknown model 'gpt-9'; presets: gpt2, gpt2-medium"),
    (["search", "--model", "nofile.yaml", "--cluster", "a100-80gb:8x1"], "does not exist"),
    (["estimate", "--model", "gpt2-1.5b", "--cluster", "a100-80gb:8x1", "--tp", "2", "--pp", "1", "--dp", "4",
      "--mbs", "1"], "tp=2 does not divide the 25 attention heads"),
    (["estimate", "--model", "gpt2-345m", "--cluster", "a10:4x2", "--tp", "8", "--pp", "1", "--dp", "1",
      "--mbs", "1"], "TP groups must stay inside a node"),
    (["estimate", "--model", "gpt2-345m", "--cluster", "a100-80gb:8x1", "--tp", "1", "--pp", "1", "--dp", "3",
      "--mbs", "1"], "does not match whole nodes"),
    (["estimate", "--model", "gpt2-345m", "--cluster", "a100-80gb:8x1", "--tp", "1", "--pp", "1", "--dp", "8",
      "--mbs", "3"], "not divisible by dp*mbs"),
    (["estimate", "--model", "llama-2-7b", "--cluster", "v100:8x1", "--tp", "8", "--pp", "1", "--dp", "1",
      "--mbs", "1"], "no bfloat16"),
    (["estimate", "--model", "gpt2-345m", "--cluster", "a100-80gb:8x1", "--tp", "1", "--pp", "50", "--dp", "1",
      "--mbs", "1"], "exceeds the 24 layers"),
])
def test_bad_input_gives_clear_errors(argv, needle, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2
    assert needle in err


def test_bad_yaml_inputs(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("nodes:\n  - gpu: a100-80gb\n    count: 2\n    colour: red\n")
    code, _, err = run(["search", "--model", "gpt2-345m", "--cluster", str(bad)], capsys)
    assert code == 2 and "unknown fields ['colour']" in err
    m = tmp_path / "m.yaml"
    m.write_text("preset: llama-2-7b\nhidden: 4001\n")
    code, _, err = run(["search", "--model", str(m), "--cluster", "a100-80gb:8x1"], capsys)
    assert code == 2 and "not a multiple of heads" in err


def test_cluster_yaml_overrides(tmp_path, capsys):
    from computron.planner.hardware import load_cluster

    y = tmp_path / "c.yaml"
    y.write_text("gpus:\n  mygpu: {tflops: 200, memory_gib: 48, hbm_GBps: 1000}\n"
                 "nodes:\n  - {gpu: a100-80gb, count: 2, inter_Gbps: 800, price_per_hour: 20}\n"
                 "  - {gpu: mygpu, gpus_per_node: 4, count: 3}\n")
    cl = load_cluster(str(y))
    a, g = cl.node_types
    assert a.inter_bw == pytest.approx(100e9) and a.price == 20 and a.gpus_per_node == 8
    assert g.gpu.tflops == 200 and g.count == 3 and cl.total_gpus == 28


def test_estimate_interleaved_and_zero1(tmp_path, capsys):
    base = ["estimate", "--model", "gpt3-13b", "--cluster", "a100-80gb:8x4", "--tp", "8", "--pp", "4", "--dp", "1",
            "--mbs", "1", "--global-batch", "64"]
    plain, inter, zero = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    assert run(base + ["--json", str(plain)], capsys)[0] == 0
    assert run(base + ["--virtual-stages", "2", "--json", str(inter)], capsys)[0] == 0
    a, b = json.loads(plain.read_text()), json.loads(inter.read_text())
    assert b["virtual_stages"] == 2 and b["bubble_s"] < a["bubble_s"]  # interleaving shrinks the bubble
    dp = ["estimate", "--model", "gpt3-1.3b", "--cluster", "a100-80gb:8x2", "--tp", "1", "--pp", "1", "--dp", "16",
          "--mbs", "1"]
    assert run(dp + ["--json", str(plain)], capsys)[0] == 0
    assert run(dp + ["--zero1", "--json", str(zero)], capsys)[0] == 0
    assert json.loads(zero.read_text())["max_mem_gib"] < json.loads(plain.read_text())["max_mem_gib"]


def test_search_cost_objective_from_cli(tmp_path, capsys):
    j = tmp_path / "cost.json"
    code, out, _ = run(["search", "--model", "gpt2-345m", "--cluster", "a100-80gb:8x2,v100:8x2", "--objective", "cost",
                        "--time-limit", "5", "--top", "3", "--json", str(j)], capsys)
    assert code == 0
    plans = json.loads(j.read_text())["plans"]
    assert all(p["iteration_s"] <= 5 for p in plans)
    assert [p["cost_per_iteration"] for p in plans] == sorted(p["cost_per_iteration"] for p in plans)


def test_zero_stages_and_the_zero1_alias(tmp_path, capsys):
    j = tmp_path / "p.json"
    base = ["search", "--model", "gpt2-345m", "--cluster", "a100-80gb:8x1,v100:8x1", "--top", "4", "--json", str(j)]
    assert run(base + ["--zero", "0"], capsys)[0] == 0
    assert {p["zero"] for p in json.loads(j.read_text())["plans"]} == {0}
    assert run(base + ["--zero1"], capsys)[0] == 0
    plans = json.loads(j.read_text())["plans"]
    assert {p["zero"] for p in plans if p["dp"] > 1} == {1} and all(p["zero1"] == (p["zero"] == 1) for p in plans)
    code, _, err = run(base + ["--zero", "4"], capsys)
    assert code == 2 and "ZeRO stages" in err


def test_estimate_zero3_cp_fp8_and_tp_overlap(tmp_path, capsys):
    j = tmp_path / "e.json"
    est = ["estimate", "--model", "llama-3-8b", "--cluster", "h100:8x2", "--tp", "4", "--pp", "1", "--dp", "2",
           "--mbs", "1", "--global-batch", "16", "--sequence-parallel", "--recompute", "selective", "--json", str(j)]
    code, out, _ = run(est + ["--cp", "2", "--zero", "3", "--fp8", "--tp-overlap"], capsys)
    assert code == 0 and "cp=2" in out and "zero=3" in out and "fp8=on" in out and "tp-overlap=on" in out
    row = json.loads(j.read_text())
    assert (row["cp"], row["zero"], row["fp8"], row["tp_overlap"]) == (2, 3, True, True) and "cp_s" in row
    code, _, err = run(est[:-2] + ["--cp", "2", "--tp-overlap", "--fp8"] + ["--zero", "1"], capsys)
    assert code == 0
    a100 = [x if x != "h100:8x2" else "a100-80gb:8x2" for x in est]
    code, _, err = run(a100 + ["--cp", "2", "--fp8"], capsys)
    assert code == 2 and "no fp8" in err
    no_sp = [x for x in est if x != "--sequence-parallel"]
    code, _, err = run(no_sp + ["--cp", "2", "--tp-overlap"], capsys)
    assert code == 2 and "needs sequence parallelism" in err
    code, _, err = run(["estimate", "--model", "gpt3-1.3b", "--cluster", "a100-80gb:8x2", "--tp", "1", "--pp", "1",
                        "--dp", "8", "--cp", "2", "--mbs", "1"], capsys)
    assert code == 2 and "fused attention" in err


def test_progress_bar_only_on_a_terminal(monkeypatch, capsys):
    argv = ["search", "--model", "gpt2-345m", "--cluster", "a100-80gb:8x1,v100:8x1", "--top", "1"]
    code, _, err = run(argv, capsys)
    assert code == 0 and err == ""  # stderr is not a terminal here: nothing
    bar = cli._Progress()
    monkeypatch.setattr(cli.sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(cli._Progress, "DELAY_S", 0.0)
    with bar as cb:
        assert cb is bar
        cb(1.0, 2.0, {"simulated": 3})
        assert bar.bar is not None and bar.bar.tasks[0].completed == pytest.approx(0.5)
    assert "best 2.000 s" in capsys.readouterr().err


def test_cuda_graphs_plan_every_layout_at_its_graphed_time(tmp_path, capsys):
    """``--cuda-graphs``: a layout takes the profile's ``graph_s`` and its tp all-reduces their ring time
    alone, a pipeline's stages too (the trainer graphs them, ``train/stage_graphs.py``)."""
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY)
    entries = [{"tp": t, "mbs": b, "fwd_s": 1e-3 * b / t, "bwd_s": 2e-3 * b / t, "act_bytes": 1000 * b,
                "graph_s": 1.5e-3 * b / t} for t in (1, 2) for b in (1, 2)]
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps({"gpu": "a100-80gb", "model": {"name": "tiny", "family": "gpt", "hidden": 64,
                                                               "heads": 4, "ffn": 256, "seq_len": 32},
                                "entries": entries}))

    def estimate(layout, *graphs):
        j = tmp_path / "est.json"
        code, _, err = run(["estimate", "--model", str(model), "--cluster", "a100-80gb:2x1", *layout, "--mbs", "2",
                            "--profile", str(prof), "--json", str(j), *graphs], capsys)
        assert code == 0, err
        return json.loads(j.read_text())["iteration_s"]

    flat = ["--tp", "2", "--pp", "1", "--dp", "1"]
    assert estimate(flat, "--cuda-graphs") < estimate(flat)
    piped = ["--tp", "1", "--pp", "2", "--dp", "1"]
    assert estimate(piped, "--cuda-graphs") < estimate(piped)
