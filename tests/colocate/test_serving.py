"""The serving engine under the arbiter, on the CPU: a real `computron serve --colocate` and a real
training job, each a process of its own, with the official OpenAI client.

Inference's share of the device starts at 0 (training holds it all); a burst of requests to two
models takes what they need from training, which shrinks its micro-batch; every request is
answered; after the idle time the models are evicted, the share goes back to 0 and training runs
full micro-batches again; a second burst swaps the models in again. Then `computron colocate`
starts both with one command.
"""

import os
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from computron.server.background import free_port
from computron.train.config import TrainConfig
from computron.train.job import Trainer

from test_handover import Proc

TRAIN = dict(model="tiny-opt", seq_len=16, global_batch=8, micro_batch=8)
MODELS = ("tiny-opt", "tiny-gpt2")


def wait_health(url, proc, timeout=90):
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)


def memory(url):
    body = httpx.get(url + "/v1/models").json()
    return body["memory"]["devices"][0], {m["id"]: m["state"] for m in body["data"]}


def burst(url, n=6):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")

    def one(i):
        r = client.completions.create(model=MODELS[i % 2], prompt="hello there", max_tokens=5, temperature=0.0)
        return r.choices[0]

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def wait_for(fn, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def serve_args(port, extra=()):
    # a budget whose arena holds the job at its full micro-batch, or both models beside a smaller one
    return ["serve", *[a for m in MODELS for a in ("--model", m)], "--device", "cpu", "--port", str(port),
            "--gpu-memory-budget", "5800000", "--workspace", "100000", "--log-level", "info", *extra]


def test_serve_hands_memory_to_and_from_a_training_job(tmp_path):
    addr, port = str(tmp_path / "arb.sock"), free_port()
    url = f"http://127.0.0.1:{port}"
    server = Proc(["computron.cli", *serve_args(port, ("--colocate", addr, "--colocate-idle", "1.5"))])
    job = None
    try:
        wait_health(url, server.p)
        dev, _ = memory(url)
        capacity = dev["capacity"]
        assert dev["share"] == 0  # colocate mode: inference starts with nothing and asks
        mm = Trainer(TrainConfig(**TRAIN)).memory_model()
        assert mm.predict(8) <= capacity  # the job fits whole when inference is idle
        job = Proc(["computron.cli", "train", "--colocate", addr, "--steps", "100000", "--device", "cpu",
                    *[f"--{k.replace('_', '-')}={v}" for k, v in TRAIN.items()]])
        job.wait_line(r"micro-batches \[8\]")
        for round_ in range(2):
            n = len(job.lines)
            answers = burst(url)
            assert [a.finish_reason for a in answers] == ["length"] * 6 and all(a.text for a in answers)
            dev, states = memory(url)
            # inference got what the two models and their requests need, out of training's share
            assert dev["share"] > 0 and dev["weights"] > 0 and dev["share"] >= dev["weights"] + dev["kv"], dev
            assert dev["share"] <= capacity
            # the job shrank its micro-batch to the rest: training + inference never exceed the device
            # (a step's last micro-batch: those before it may have run before the handover)
            line = job.wait_line(r"micro-batches \[([0-9]+, )*[1-7]\]", start=n)
            m = int(line.split("micro-batches [")[1].split("]")[0].split(",")[-1])
            assert mm.predict(m) <= capacity - dev["share"] * 0.9, (line, dev)
            # the handover as the waiting request saw it: from its arrival to the memory mapped
            moved = [h for h in httpx.get(url + "/colocation").json()["handovers"] if h["signal_s"] is not None]
            assert moved and all(h["free_s"] is not None and h["free_s"] >= h["wait_s"] + h["alloc_s"] for h in moved)
            # idle: the models are evicted down to the share of 0 and training grows back
            wait_for(lambda: memory(url)[0]["share"] == 0)
            dev, states = memory(url)
            assert dev["weights"] == 0 and set(states.values()) == {"offloaded"}, (dev, states)
            job.wait_line(r"micro-batches \[8\]", start=len(job.lines))
        assert any("inference budget" in l for l in server.lines)
        # the job dies: the server goes on answering, its budget grows to what it needs
        job.kill()
        assert all(a.finish_reason == "length" for a in burst(url, 2))
    finally:
        for p in (job, server):
            if p is not None and p.p.poll() is None:
                p.kill()


def test_colocate_command_starts_both_and_stops_both(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = " ".join(serve_args(port)[1:])
    train = " ".join(["--device", "cpu", "--steps", "100000", *[f"--{k.replace('_', '-')}={v}" for k, v in
                                                                TRAIN.items()]])
    p = Proc(["computron.cli", "colocate", "--serve", serve, "--train", train, "--mode", "colocate",
              "--yield", "work", "--address", str(tmp_path / "arb.sock")])
    try:
        wait_health(url, p.p)
        p.wait_line("micro-batches")  # the job runs under the arbiter
        assert all(a.finish_reason == "length" for a in burst(url, 2))
        assert memory(url)[0]["share"] > 0
        assert any("arbiter on" in l for l in p.lines)
        rep = httpx.get(f"{url}/colocation", timeout=10).json()
        # the job was told to yield the compute while the burst ran, and to go on after it
        assert rep["yield_compute"] == "work" and [on for _, _, on in rep["yields"]][:2] == [True, False], rep["yields"]
    finally:
        p.p.send_signal(signal.SIGINT)
        try:
            p.p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
    assert p.p.returncode == 0, p.lines[-30:]


def _children(pid: int) -> dict[str, dict[str, str]]:
    """The processes ``pid`` started (Linux /proc): their command lines -> their environments."""
    out = {}
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                cmd = open(f"/proc/{d}/cmdline").read().replace("\0", " ")
                env = open(f"/proc/{d}/environ").read().split("\0")
                out[cmd] = dict(e.split("=", 1) for e in env if "=" in e)
        except OSError:  # it ended meanwhile
            pass
    return out


def test_colocate_started_in_the_background_stops_both_on_sigterm_and_its_mps_server(tmp_path, monkeypatch):
    """Started as a shell starts a background command (SIGINT ignored, which children inherit), the
    command is stopped with SIGTERM, and its server and job still hear the Ctrl-C it sends them: they
    end on their own at once, not killed when its timeout runs out. With ``--mps`` both are clients of
    an MPS control daemon started with folders of its own (here a stand-in for nvidia-cuda-mps-control
    that writes down how it was called), told to quit once they ended; only the job gets the
    cudaMallocAsync allocator."""
    calls = tmp_path / "mps_calls"
    fake = tmp_path / "bin" / "nvidia-cuda-mps-control"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nif [ "$1" = -d ]; then what=start; else what=$(cat); fi\n'
                    f'echo "$what $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> {calls}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    train = " ".join(["--device", "cpu", "--steps", "100000", *[f"--{k.replace('_', '-')}={v}" for k, v in
                                                                TRAIN.items()]])
    p = Proc(["computron.cli", "colocate", "--serve", " ".join(serve_args(port)[1:]), "--train", train,
              "--address", str(tmp_path / "arb.sock"), "--mps"], sigint=signal.SIG_IGN)
    try:
        wait_health(url, p.p)
        p.wait_line("micro-batches")
        started = calls.read_text().split()
        assert started[0] == "start" and started[1].startswith(tempfile.gettempdir()), started
        kids = _children(p.p.pid)
        (server,) = [e for c, e in kids.items() if " serve " in c]
        (job,) = [e for c, e in kids.items() if " train " in c]
        for env in (server, job):  # both are clients of that daemon
            assert (env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"]) == tuple(started[1:])
        assert job["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync" and "PYTORCH_CUDA_ALLOC_CONF" not in server
        t = time.monotonic()
        p.p.send_signal(signal.SIGTERM)
        p.p.wait(60)
        took = time.monotonic() - t
    finally:
        if p.p.poll() is None:
            p.kill()
    assert p.p.returncode == 0 and took < 15, (took, p.lines[-10:])  # killing one would take the 20 s timeout
    p.wait_line("Application shutdown complete")  # the server shut down as Ctrl-C does
    assert calls.read_text().splitlines()[1].split() == ["quit", *started[1:]]  # the daemon was told to quit


def test_colocate_mps_without_its_control_program_stops_before_starting_anything(tmp_path, monkeypatch, capsys):
    from computron.cli import main

    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["colocate", "--mps", "--serve", "--model tiny-opt", "--train", "--steps 1"]) == 2
    assert "--mps: no nvidia-cuda-mps-control on PATH" in capsys.readouterr().err


def test_colocate_defaults_yield_until_the_first_token_and_run_the_job_under_cudamallocasync():
    """The defaults are the configuration measured to meet both targets: first-token yields, the job's
    allocator cudaMallocAsync (for the job alone; an allocator the user configured is kept)."""
    import argparse

    from computron.colocate.cli import add_parser, commands, job_env

    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    args = ap.parse_args(["colocate", "--serve", "--model tiny", "--train", "--steps 3"])
    serve, train = commands(args, "/tmp/arb.sock")
    assert serve[serve.index("--colocate-yield") + 1] == "first-token"
    assert train[-2:] == ["--colocate", "/tmp/arb.sock"] and "--steps" in train
    assert args.job_allocator == "async"
    assert job_env("async", {"PATH": "/bin"}) == {"PATH": "/bin", "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    assert job_env("native", {"PATH": "/bin"}) == {"PATH": "/bin"}
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert job_env("async", mine) == mine
    with pytest.raises(ValueError, match="unknown allocator 'cuda'"):
        job_env("cuda", {})


def test_stopping_signals_every_process_at_once_and_kills_what_ignores_it():
    """``computron colocate`` stops the server and the job together: each gets Ctrl-C at once (the
    server's does not wait for the job's to end), and whatever ignores it is killed when the one
    timeout runs out, not one timeout after another."""
    import sys

    from computron.colocate.cli import stop_all

    ignore = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    obey = "import time; print('ready', flush=True); time.sleep(60)"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as under a shell
             for code in (ignore, ignore, obey)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"  # their handlers are in place
    t = time.monotonic()
    rcs = stop_all(procs, timeout=1.5)
    took = time.monotonic() - t
    assert rcs == [-signal.SIGKILL, -signal.SIGKILL, -signal.SIGINT]  # Python ends by the Ctrl-C it did not catch
    assert 1.4 < took < 2.9, took  # one timeout for all, not 1.5 s each
    for p in procs:
        p.stdout.close()
