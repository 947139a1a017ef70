"""The command line: serve's configuration precedence and embedded default (a real process), ps, bench serve."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from computron.server.background import free_port
from computron.server.cli import DEFAULT_BUDGET, DEFAULT_MODELS, add_bench_parser, add_parsers, build_config


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="computron")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parsers(sub)
    add_bench_parser(sub.add_parser("bench").add_subparsers(dest="bench", required=True))
    return parser.parse_args(argv)


def test_wiring():
    args = parse("serve")
    assert args.func.__name__ == "serve_main"
    assert parse("ps").func(argparse.Namespace(url="http://127.0.0.1:9", api_key=None, json=False)) == 1
    assert parse("bench", "serve", "-n", "2").func.__name__ == "bench_main"


def test_embedded_default(monkeypatch):
    monkeypatch.delenv("COMPUTRON_API_KEY", raising=False)
    cfg = build_config(parse("serve"))
    assert [m.name for m in cfg.models] == list(DEFAULT_MODELS)
    assert cfg.engine.gpu_memory_budget == DEFAULT_BUDGET and cfg.engine.device == "auto"
    assert cfg.server.host == "127.0.0.1" and cfg.server.port == 8000 and cfg.server.api_key is None


def test_flags_override_file_override_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("COMPUTRON_API_KEY", raising=False)
    path = tmp_path / "c.yaml"
    path.write_text("engine: {gpu_memory_budget: 2GiB, policy: computron}\n"
                    "server: {port: 9001, max_queue: 7, api_key: from-file, model_dirs: [/a]}\n"
                    "models: [tiny-opt, {source: tiny-gpt2, alias: g, pinned: true}]\n")
    cfg = build_config(parse("serve", "--config", str(path)))
    assert [m.name for m in cfg.models] == ["tiny-opt", "g"] and cfg.models[1].pinned
    assert cfg.engine.gpu_memory_budget == 2 * 2**30 and cfg.engine.policy == "computron"
    assert (cfg.server.port, cfg.server.max_queue, cfg.server.api_key, cfg.server.model_dirs) == (9001, 7, "from-file",
                                                                                                  ["/a"])
    monkeypatch.setenv("COMPUTRON_API_KEY", "from-env")
    assert build_config(parse("serve", "--config", str(path))).server.api_key == "from-env"
    cfg = build_config(parse("serve", "--config", str(path), "--model", "tiny-llama=l", "--gpu-memory-budget", "1MiB",
                             "--port", "9002", "--api-key", "flag", "--max-queue", "3", "--model-dir", "/b",
                             "--host", "0.0.0.0", "--policy", "default", "--device", "cpu"))
    assert [(m.source, m.name) for m in cfg.models] == [("tiny-llama", "l")]
    assert cfg.engine.gpu_memory_budget == 2**20 and cfg.engine.policy == "default" and cfg.engine.device == "cpu"
    assert (cfg.server.host, cfg.server.port, cfg.server.api_key, cfg.server.max_queue, cfg.server.model_dirs) == (
        "0.0.0.0", 9002, "flag", 3, ["/b"])
    with pytest.raises(ValueError, match="twice"):
        build_config(parse("serve", "--model", "tiny-opt", "--model", "tiny-opt"))
    assert build_config(parse("serve", "--config", str(path), "--decode-steps", "8")).engine.decode_steps == 8
    with pytest.raises(ValueError, match="decode_steps must be an integer from 1 to 64, got 0"):
        build_config(parse("serve", "--decode-steps", "0"))
    assert build_config(parse("serve", "--models-per-step", "3")).engine.models_per_step == 3
    with pytest.raises(ValueError, match="models_per_step must be an integer of at least 1, got 0"):
        build_config(parse("serve", "--models-per-step", "0"))
    eng = build_config(parse("serve", "--workers-listen", "10.0.0.1:29600", "--local-devices", "2")).engine
    assert (eng.workers_listen, eng.local_devices) == ("10.0.0.1:29600", 2)
    assert not eng.preempt_keeps_kv and build_config(parse("serve", "--preempt-keep-kv")).engine.preempt_keeps_kv
    assert eng.kv_host_bytes == 0 and build_config(parse("serve", "--kv-host", "2GiB", "--policy", "slo")).engine.kv_host_bytes == 2**31
    assert eng.stripe_devices == [] and build_config(parse("serve", "--stripe-devices", "1,3")).engine.stripe_devices == [1, 3]
    for bad, why in (("1,x", "device indexes separated by commas"), ("2,2", "distinct device indexes")):
        with pytest.raises(ValueError, match=why):
            build_config(parse("serve", "--stripe-devices", bad))


def test_slo_flags_set_each_models_slo_from_the_named_calibration():
    from computron.engine import Engine
    from computron.scheduler import ModelCost, Slo
    from computron.sim.costs import calibration

    cfg = build_config(parse("serve", "--policy", "slo", "--slo-scale", "3", "--slo-calibration", "cpu",
                             "--device", "cpu", "--gpu-memory-budget", "256MiB"))
    assert (cfg.engine.slo_scale, cfg.engine.slo_calibration) == (3.0, "cpu")
    eng = Engine(cfg.engine)
    eng.register_model("tiny-opt")
    info = eng.core.models["tiny-opt"]
    cost = ModelCost.from_calibration(calibration("cpu"), info.weight_bytes, info.placement.devices)
    assert eng.core.scheduler.slo.slos["tiny-opt"] == Slo.solo(cost, 3.0)
    default = Engine(build_config(parse("serve", "--policy", "slo", "--device", "cpu",
                                        "--gpu-memory-budget", "256MiB")).engine)
    assert default.core.slo_calibration == "cpu"  # none named: the built-in one of the device kind
    with pytest.raises(ValueError, match="policy 'default' would never use it"):
        build_config(parse("serve", "--kv-host", "1GiB"))
    assert build_config(parse("serve", "--kv-host", "1GiB", "--policy", "slo")).engine.kv_host_bytes == 2**30
    with pytest.raises(ValueError, match="--slo-scale must be > 0"):
        build_config(parse("serve", "--slo-scale", "0"))


def test_serve_errors_exit_2(capsys):
    assert parse("serve", "--model", "no-such-model").func(parse("serve", "--model", "no-such-model")) == 2
    assert "no-such-model" in capsys.readouterr().err
    args = parse("serve", "--model", "tiny-opt", "--policy", "slo", "--slo-calibration", "/no/such/cal.json")
    assert args.func(args) == 2
    assert "/no/such/cal.json" in capsys.readouterr().err
    import socket

    with socket.socket() as busy:  # a port in use: refused before anything is built or logged as serving
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = parse("serve", "--port", str(port))
        assert args.func(args) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err


def test_serve_process_and_ps(tmp_path, capsys):
    """`computron serve` with no arguments in a process of its own: the embedded default, then `ps`."""
    port = free_port()
    env = {**os.environ, "COMPUTRON_API_KEY": "", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "computron.server.cli", "serve", "--port", str(port),
                             "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200
        args = parse("ps", "--url", url)
        assert args.func(args) == 0
        out = capsys.readouterr().out
        for name in DEFAULT_MODELS:
            assert name in out
        assert "resident" in out and "offloaded" in out and "dp=1 tp=1 pp=1" in out
        args = parse("ps", "--url", url, "--json")
        assert args.func(args) == 0
        assert {m["id"] for m in json.loads(capsys.readouterr().out)["data"]} == set(DEFAULT_MODELS)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out
    assert "building host image" in out and "ready" in out


def test_bench_serve(tmp_path, capsys):
    out = tmp_path / "serve.json"
    args = parse("bench", "serve", "--model", "tiny-opt", "-n", "3", "-c", "2", "-r", "8", "--rate", "200",
                 "--prompt-len", "8", "--max-tokens", "6", "--warmup", "1", "--device", "cpu",
                 "--gpu-memory-budget", str(DEFAULT_BUDGET), "--workspace", "100000", "--out", str(out))
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["machine"]["torch"] and report["machine"]["date"] and report["settings"]["copies"] == 3
    for path in ("direct", "http"):
        r = report["results"][path]
        assert r["requests"] == 8 and r["output_tokens"] == 8 * 6
        assert r["ttft_p50_ms"] > 0 and r["latency_p99_ms"] >= r["latency_p50_ms"] and r["throughput_tok_s"] > 0
        assert r["swap_ins"] >= 1
    assert "latency_p50_ms" in report["http_overhead_pct"]
    printed = capsys.readouterr().out
    assert "http" in printed and "direct" in printed
