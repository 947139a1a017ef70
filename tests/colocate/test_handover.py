"""The two-process handover on the CPU: a training job and an inference stand-in as real processes.

One scenario, in order: the job joins and trains at its full micro-batch; inference asks for
memory and gets it after a limit message and an ack (timed in parts); the job keeps training in
smaller micro-batches; after inference idles, the memory goes back; the server restarts and the
job finds it again; the job is killed and the server hands its share to inference at once.
"""

import json
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from computron.train.config import TrainConfig
from computron.train.job import Trainer

TRAIN = dict(model="tiny-opt", seq_len=16, global_batch=8, micro_batch=8)


class Proc:
    def __init__(self, args, stdin=False, sigint=signal.SIG_DFL):
        # Ctrl-C at its default in the child: tests stop it with SIGINT, and a pytest started in the
        # background (``&``) ignores SIGINT, which its children would inherit (``sigint=SIG_IGN``
        # starts it as a shell starts a background command)
        self.p = subprocess.Popen([sys.executable, "-m", *args], stdin=subprocess.PIPE if stdin else None,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
        self.lines: list[str] = []
        self._new = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            with self._new:
                self.lines.append(line.rstrip("\n"))
                self._new.notify_all()

    def wait_line(self, pattern, start=0, timeout=60.0):
        with self._new:
            ok = self._new.wait_for(lambda: any(re.search(pattern, l) for l in self.lines[start:]), timeout)
        assert ok, f"no line matching {pattern!r} in {self.lines[-20:]}"
        return next(l for l in self.lines[start:] if re.search(pattern, l))

    def ask(self, cmd, timeout=60.0):
        n = len(self.lines)
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return json.loads(self.wait_line(r"^\{", start=n, timeout=timeout))

    def kill(self):
        self.p.kill()
        self.p.wait(10)


def standin(addr, capacity):
    s = Proc(["computron.colocate.standin", "--address", addr, "--mode", "colocate", "--capacity", str(capacity),
              "--idle", "1.5"], stdin=True)
    s.wait_line("ready")
    return s


def test_two_process_handover_survives_restarts_and_death(tmp_path):
    mm = Trainer(TrainConfig(**TRAIN)).memory_model()  # the job's own prior (no measured peaks on the CPU)
    capacity = mm.predict(8)
    demand = capacity - mm.predict(3)
    addr = str(tmp_path / "arbiter.sock")
    server = standin(addr, capacity)
    job = Proc(["computron.cli", "train", "--colocate", addr, "--steps", "100000", "--device", "cpu",
                *[f"--{k.replace('_', '-')}={v}" for k, v in TRAIN.items()]])
    try:
        assert server.ask("wait-trainer 0 60") == {"connected": True}
        job.wait_line(r"micro-batches \[8\]")
        # inference asks; training shrinks to what is left (3 samples), acknowledged and timed
        rec = server.ask(f"demand 0 {demand} 30")
        assert rec["granted"] == demand
        for part in ("signal_s", "release_s", "reach_s", "drain_s", "empty_s", "ack_s"):
            assert rec[part] is not None and 0 <= rec[part] < 5, rec
        assert rec["wait_s"] >= rec["signal_s"] + rec["release_s"]
        assert rec["reach_s"] + rec["drain_s"] + rec["empty_s"] == pytest.approx(rec["release_s"], abs=1e-9)
        assert rec["at"] in ("between", "chosen", "running", "fence")
        assert server.ask("status 0") == {"connected": True, "inference": demand, "training": capacity - demand,
                                          "budget": demand}
        n = len(job.lines)
        job.wait_line(r"micro-batches \[[1-3](, [1-3])*\]", start=n)  # a step in micro-batches of at most 3
        # idle: the memory goes back and training runs full micro-batches again
        deadline = time.monotonic() + 30
        while server.ask("status 0")["training"] != capacity and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.ask("status 0")["inference"] == 0
        job.wait_line(r"micro-batches \[8\]", start=len(job.lines))
        # the server restarts: the job keeps training and finds the new one
        server.kill()
        time.sleep(0.3)
        assert job.p.poll() is None
        server = standin(addr, capacity)
        assert server.ask("wait-trainer 0 60") == {"connected": True}
        rec = server.ask(f"demand 0 {demand} 30")
        assert rec["granted"] == demand and rec["signal_s"] is not None
        # the job dies: its share goes to inference without any handover
        job.kill()
        rec = server.ask(f"demand 0 {capacity} 30")
        assert rec["granted"] == capacity and rec["signal_s"] is None
        assert server.ask("status 0")["connected"] is False
    finally:
        for p in (job, server):
            if p.p.poll() is None:
                p.kill()
