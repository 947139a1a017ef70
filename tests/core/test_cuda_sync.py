"""``COMPUTRON_CUDA_SYNC`` read and checked (the GPU side: tests/gpu/test_cuda_sync_gpu.py)."""

import subprocess
import sys

import pytest

from computron import cuda_sync


def test_policy_values():
    assert cuda_sync.policy({}) == "auto"
    assert cuda_sync.policy({"COMPUTRON_CUDA_SYNC": " Blocking "}) == "blocking"
    for v in ("spin", "yield", "auto"):
        assert cuda_sync.policy({"COMPUTRON_CUDA_SYNC": v}) == v
    with pytest.raises(ValueError, match=r"\$COMPUTRON_CUDA_SYNC='sleep': expected one of auto, spin, yield, blocking"):
        cuda_sync.policy({"COMPUTRON_CUDA_SYNC": "sleep"})


def test_apply_without_a_driver_says_so(monkeypatch):
    monkeypatch.setattr(cuda_sync, "_driver", lambda: None)
    assert cuda_sync.apply({"COMPUTRON_CUDA_SYNC": "blocking"}) == \
        "CUDA waits: COMPUTRON_CUDA_SYNC=blocking ignored, no CUDA driver on this machine"
    assert cuda_sync.apply({}) == "CUDA waits: CUDA's default"
    assert cuda_sync.current(0) is None


def test_train_refuses_a_bad_value_before_building_anything(tmp_path):
    out = subprocess.run([sys.executable, "-m", "computron.cli", "train", "--model", "tiny-opt", "--steps", "1",
                          "--device", "cpu"], env={**__import__("os").environ, "COMPUTRON_CUDA_SYNC": "fast"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "$COMPUTRON_CUDA_SYNC='fast': expected one of auto, spin, yield, blocking" in out.stderr


def test_serve_refuses_a_bad_value():
    out = subprocess.run([sys.executable, "-m", "computron.cli", "serve", "--model", "tiny-opt", "--port", "1"],
                         env={**__import__("os").environ, "COMPUTRON_CUDA_SYNC": "fast"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "$COMPUTRON_CUDA_SYNC='fast': expected one of" in out.stderr


def test_train_with_several_ranks_refuses_a_bad_value_once(capsys, monkeypatch):
    from computron.cli import main

    monkeypatch.setenv("COMPUTRON_CUDA_SYNC", "fast")
    assert main(["train", "--model", "tiny-opt", "--steps", "1", "--device", "cpu", "--nproc", "2", "--dp", "2"]) == 2
    assert capsys.readouterr().err.count("$COMPUTRON_CUDA_SYNC='fast'") == 1
