"""``COMPUTRON_CUDA_SYNC`` on a CUDA GPU: the policy reaches the primary context, and a blocking wait
leaves its core free where the default spins on it. Each case runs in a fresh process (the flag is
set before the process first uses CUDA). Run on the lent GPU machine with `pytest -m gpu tests/gpu`."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CHILD = r"""
import json, time, torch
from computron import cuda_sync
line = cuda_sync.apply()
torch.cuda.init(); torch.zeros(1, device="cuda")
torch.cuda._sleep(1000)  # warm: the sleep kernel loaded
torch.cuda.synchronize()
cycles = int(torch.cuda.get_device_properties(0).clock_rate) * 1000 // 2  # about half a second of GPU clock
c0, w0 = time.process_time(), time.perf_counter()
torch.cuda._sleep(cycles)
torch.cuda.synchronize()
print(json.dumps({"line": line, "policy": cuda_sync.current(0), "cpu_s": time.process_time() - c0,
                  "wall_s": time.perf_counter() - w0}))
"""


def _wait(policy: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "COMPUTRON_CUDA_SYNC"}
    if policy:
        env["COMPUTRON_CUDA_SYNC"] = policy
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.splitlines()[-1])


def test_blocking_wait_sleeps_where_spin_holds_the_core():
    spin, blocking = _wait("spin"), _wait("blocking")
    assert (spin["policy"], blocking["policy"]) == ("spin", "blocking")
    assert "blocking on" in blocking["line"]
    for r in (spin, blocking):
        assert r["wall_s"] > 0.2, r  # the kernel really kept the GPU busy that long
    assert spin["cpu_s"] > 0.8 * spin["wall_s"], spin  # spinning: the wait holds a core
    assert blocking["cpu_s"] < 0.2 * blocking["wall_s"], blocking  # asleep until the GPU is done


def test_unset_leaves_cuda_default():
    r = _wait(None)
    assert r["policy"] == "auto" and r["line"] == "CUDA waits: CUDA's default"
