"""`computron colocate --mps` on a GPU: both processes run as clients of the MPS server of a control
daemon the command started itself, requests are answered while the job trains, and once both have
ended the daemon and its server are gone. `pytest -m gpu tests/gpu/test_colocate_mps_gpu.py -s` on
the lent GPU machine (it prints the daemon's logs)."""

import json
import os
import re
import shutil
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "colocate"))
from test_handover import Proc  # noqa: E402

from computron.server.background import free_port  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None,
                                 reason="needs nvidia-cuda-mps-control (NVIDIA driver)")]


def _procs(name: str) -> dict[int, dict[str, str]]:
    """Processes of the program ``name`` (Linux /proc; by the command line, as ``comm`` is cut at 15
    characters): pid -> environment (empty where it cannot be read)."""
    out = {}
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and os.path.basename(open(f"/proc/{d}/cmdline").read().split("\0")[0]) == name:
                try:
                    env = open(f"/proc/{d}/environ").read().split("\0")
                except OSError:
                    env = []
                out[int(d)] = dict(e.split("=", 1) for e in env if "=" in e)
        except OSError:  # it ended meanwhile
            pass
    return out


def _descendants(pid: int) -> set[int]:
    parent = {}
    for d in os.listdir("/proc"):
        try:
            if d.isdigit():
                parent[int(d)] = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            pass
    out, new = set(), {pid}
    while new:
        new = {p for p, pp in parent.items() if pp in new} - out
        out |= new
    return out


def _complete(url: str, model: str) -> dict:
    body = json.dumps({"model": model, "prompt": "hello there", "max_tokens": 5, "temperature": 0.0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_colocate_mps_serves_and_trains_as_clients_of_its_own_mps_server(tmp_path):
    servers_before = set(_procs("nvidia-cuda-mps-server"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = f"--model tiny-opt --model tiny-gpt2 --port {port} --gpu-memory-budget 2GiB --log-level info"
    train = "--model tiny-opt --seq-len 16 --global-batch 8 --micro-batch 8 --steps 100000"
    p = Proc(["computron.cli", "colocate", "--mps", "--serve", serve, "--train", train,
              "--address", str(tmp_path / "arb.sock")])
    try:
        pipe = p.wait_line(r"an MPS server for both processes \(").rsplit("(", 1)[1].rstrip(")")
        deadline = time.monotonic() + 180
        while True:
            assert p.p.poll() is None, p.lines[-30:]
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, p.lines[-30:]
            time.sleep(0.2)
        p.wait_line("micro-batches", timeout=120)
        for i in range(4):
            out = _complete(url, ("tiny-opt", "tiny-gpt2")[i % 2])
            assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 5, out
        n = len(p.lines)
        p.wait_line("micro-batches", start=n, timeout=120)  # the job goes on training after the requests
        ours = _descendants(p.p.pid)
        (daemon,) = [pid for pid, env in _procs("nvidia-cuda-mps-control").items()
                     if env.get("CUDA_MPS_PIPE_DIRECTORY") == pipe]
        new_servers = set(_procs("nvidia-cuda-mps-server")) - servers_before
        assert new_servers, "no MPS server started: the processes did not connect to the daemon"
        log_dir = Path(_procs("nvidia-cuda-mps-control")[daemon]["CUDA_MPS_LOG_DIRECTORY"])
        control = (log_dir / "control.log").read_text()
        server_log = (log_dir / "server.log").read_text() if (log_dir / "server.log").exists() else ""
        print("control.log:\n" + control + "\nserver.log:\n" + server_log)
        # the daemon took in the job and the server (or a worker of the server's), and nothing else
        clients = {int(c) for c in re.findall(r"NEW CLIENT (\d+) from", control)}
        job = [pid for pid in ours if " train " in open(f"/proc/{pid}/cmdline").read().replace("\0", " ")]
        serving = [pid for pid in ours if " serve " in open(f"/proc/{pid}/cmdline").read().replace("\0", " ")]
        assert len(job) == 1 and len(serving) == 1, (job, serving)
        assert job[0] in clients and clients & (_descendants(serving[0]) | set(serving)), (clients, job, serving)
        assert clients <= ours, (clients, sorted(ours))
        p.p.send_signal(signal.SIGINT)
        p.p.wait(90)
    finally:
        if p.p.poll() is None:
            p.kill()
    assert p.p.returncode == 0, p.lines[-20:]
    time.sleep(1.0)
    assert daemon not in _procs("nvidia-cuda-mps-control"), "the daemon was not told to quit"
    assert not (set(_procs("nvidia-cuda-mps-server")) - servers_before), "its MPS server is still running"
