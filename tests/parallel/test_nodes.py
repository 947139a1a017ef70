"""Workers of another node on one machine: a second group of processes, started by torchrun with
``computron worker``, joins the engine's process group (gloo, loopback) and its authenticated
control channel; a tp=2 model whose ranks are on the two "nodes" gives the tokens of tp=1, and
again after the worker of the other node was killed (torchrun starts it again; the engine restarts
its world)."""

import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import AuthenticationError, Client
from pathlib import Path

import pytest

import computron
from computron.config import EngineConfig, ModelSpec
from computron.engine import Engine, SamplingParams
from computron.engine.workers import WorkerExecutor

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello", "the quick brown fox", "1 2 3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_across_two_nodes_gives_the_tokens_of_tp1(tmp_path):
    cfg = dict(device="cpu", gpu_memory_budget=64 * 2**20, workspace_bytes=50_000)
    ref = Engine(EngineConfig(**cfg))
    ref.register_model("tiny-opt")
    want = [ref.generate("tiny-opt", p, GREEDY).output_ids for p in PROMPTS]

    port, key = free_port(), os.urandom(16).hex()
    env = {**os.environ, "COMPUTRON_WORKER_AUTHKEY": key,
           "PYTHONPATH": os.pathsep.join([str(Path(computron.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    log = open(tmp_path / "node-b.log", "w")
    node_b = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "--max-restarts=1",
                               "-m", "computron.cli", "worker", "--connect", f"127.0.0.1:{port}", "--first-device", "1",
                               "--connect-timeout", "60"], env=env, stdout=log, stderr=subprocess.STDOUT)
    ex = None
    try:
        with pytest.raises(ValueError, match="say how many of the 2 devices are this node's"):
            WorkerExecutor(EngineConfig(executor="workers", devices=2, workers_listen=f"127.0.0.1:{port}", **cfg))
        config = EngineConfig(executor="workers", devices=2, workers_listen=f"127.0.0.1:{port}", local_devices=1, **cfg)
        ex = WorkerExecutor(config, start_timeout=90, authkey=key)
        eng = Engine(config, executor=ex)
        eng.register_model(ModelSpec("tiny-opt", tp=2))
        assert eng.models["tiny-opt"].info.placement.devices == (0, 1)
        remote = ex.worker_pids()[1]  # a child of torchrun on "node B", not of this process
        assert remote not in {p.pid for p in mp.active_children()} and remote != node_b.pid
        reqs = [eng.submit("tiny-opt", p, GREEDY) for p in PROMPTS]
        eng.run_until_done(reqs)
        assert [r.error for r in reqs] == [None] * len(reqs)
        assert [r.output_ids for r in reqs] == want
        with pytest.raises(AuthenticationError):  # the channel takes our own processes only
            Client(("127.0.0.1", port), authkey=b"not the key")
        assert eng.generate("tiny-opt", PROMPTS[0], GREEDY).output_ids == want[0]

        running = eng.submit("tiny-opt", PROMPTS[1], SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))
        eng.step(), eng.step()
        os.kill(remote, signal.SIGKILL)
        eng.run_until_done([running], max_steps=50)
        assert running.finish_reason == "error"
        assert "worker for device 1 on " in running.error and "is gone" in running.error, running.error
        again = [eng.submit("tiny-opt", p, GREEDY) for p in PROMPTS]  # the new world, with a new node-B worker
        eng.run_until_done(again)
        assert [r.output_ids for r in again] == want
        assert ex.status().stats["restarts"] == 1 and ex.worker_pids()[1] != remote
    finally:
        if ex is not None:
            ex.shutdown()
        try:
            code = node_b.wait(timeout=60)
        except subprocess.TimeoutExpired:
            node_b.kill()
            raise
        finally:
            log.close()
    assert code == 0, (tmp_path / "node-b.log").read_text()[-3000:]
