"""The `computron` command's engine parts (generate and the swap benchmarks, on the CPU) and its help without torch."""

import json
import subprocess
import sys

import pytest

from computron.cli import main


def test_generate_prints_text_and_token_count(capsys):
    assert main(["generate", "--model", "tiny-llama", "--prompt", "hello", "--max-tokens", "5", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    assert "[5 tokens, finish_reason=length]" in out.err


def test_generate_bad_input_is_a_clear_error(capsys):
    assert main(["generate", "--model", "nope", "--prompt", "x", "--device", "cpu"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--temperature", "-1", "--device", "cpu"]) == 2
    assert "temperature must be between 0 and 100" in capsys.readouterr().err


def test_bench_round_robin_both_policies(tmp_path):
    out = tmp_path / "rr.json"
    assert main(["bench", "round-robin", "tiny-opt", "-n", "2", "-r", "4", "--blocking", "--device", "cpu",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for pol in ("default", "computron"):
        p = res["policies"][pol]
        assert p["times_s"]["response"]["n"] == 4
        assert p["swap_ins"] == 6 and p["evictions"] == 5  # 2 warm-up + 4 requests, each a swap
    assert set(res["ratios_default_over_computron"]) == {"load", "evict", "compute", "response"}


def test_bench_swap_reports_against_raw_copy(tmp_path):
    out = tmp_path / "swap.json"
    assert main(["bench", "swap", "tiny-opt", "--repeats", "2", "--prompt-len", "16", "--decode-tokens", "4",
                 "--device", "cpu", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["models"]["tiny-opt"]
    assert r["bytes"] > 0 and len(r["swap_in_s"]) == 2 and len(r["raw_memcpy_s"]) == 2
    assert r["swap_over_raw_bandwidth"] > 0 and r["decode_ms_per_token"] > 0


def test_bench_rejects_nonpositive_counts(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "round-robin", "tiny-opt", "-n", "0"])
    assert "must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["ps", "--help"], ["plan", "search", "--help"],
                                  ["bench", "swap", "--help"], ["bench", "round-robin", "--help"], ["sim", "--help"],
                                  ["bench", "hybrid", "--help"]])
def test_help_works_without_torch(argv):
    code = ("import sys; sys.modules['torch'] = None; from computron.cli import main; "
            f"sys.exit(main({argv!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: computron {' '.join(argv[:-1])}".rstrip()), out.stdout


def test_model_layouts_parse_and_bad_ones_are_refused_with_the_syntax():
    from computron.config import ModelSpec

    s = ModelSpec.parse("/ckpt/llama=chat@tp=2,pp=2,devices=3+2+1+0")
    assert (s.source, s.alias, s.tp, s.pp, s.devices, s.world) == ("/ckpt/llama", "chat", 2, 2, [3, 2, 1, 0], 4)
    assert ModelSpec.parse("opt-13b@tp=2").world == 2 and ModelSpec.parse("opt-13b").world == 1
    with pytest.raises(ValueError, match=r"cannot read 'tp=two'.*tp=N, pp=N and devices=A\+B"):
        ModelSpec.parse("a@tp=two")
    with pytest.raises(ValueError, match="cannot read 'dp=2'"):
        ModelSpec.parse("a@dp=2")


def test_serve_config_picks_one_worker_per_device_for_sharded_models():
    from computron.cli import build_parser
    from computron.server.cli import build_config

    cfg = build_config(build_parser().parse_args(["serve", "--model", "tiny-opt@tp=2", "--model", "tiny-gpt2@devices=2"]))
    assert cfg.engine.executor == "workers" and cfg.engine.devices == 3


def test_bench_swap_and_round_robin_over_two_workers(tmp_path):
    """The multi-GPU runs' code path on the CPU: two gloo workers, each rank swapping its shard."""
    out = tmp_path / "swap.json"
    assert main(["bench", "swap", "tiny-opt", "--tp", "2", "--repeats", "2", "--prompt-len", "16",
                 "--decode-tokens", "4", "--device", "cpu", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["models"]["tiny-opt"]
    assert (r["executor"], r["tp"]) == ("workers", 2) and len(r["swap_in_s"]) == 2 and len(r["raw_memcpy_s"]) == 2
    assert r["decode_ms_per_token"] > 0
    out = tmp_path / "rr.json"
    assert main(["bench", "round-robin", "tiny-opt", "--pp", "2", "-n", "2", "-r", "4", "--blocking", "--device",
                 "cpu", "--out", str(out)]) == 0
    for pol in ("default", "computron"):
        p = json.loads(out.read_text())["policies"][pol]
        assert (p["pp"], p["times_s"]["response"]["n"]) == (2, 4)
        assert p["swap_ins"] == 6 and p["evictions"] == 5  # every request swaps, on both stages at once
