"""scripts/setup.sh on a machine without an NVIDIA GPU: a pinned torch with PyTorch's CPU-only index
beside the default one (a plain ``torch`` from the default index is a CUDA build of several GB),
and the pinned version from the configured indexes alone when that index cannot be used.
Run against a stand-in ``.venv/bin/python`` that records its pip calls."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/bin/sh
if [ "$1" = "-c" ]; then exit 1; fi             # import torch: not installed yet
echo "$*" >> "$(dirname "$0")/calls"
case "$*" in *--extra-index-url*) exit "${CPU_INDEX_RC:-0}";; esac
exit 0
"""


def run_setup(tmp_path: Path, cpu_index_rc: int) -> list[str]:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    path = ":".join(p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists())
    subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], check=True, capture_output=True,
                   env={**os.environ, "PATH": path, "CPU_INDEX_RC": str(cpu_index_rc)})
    return (bin_dir / "calls").read_text().splitlines()


def torch_calls(calls: list[str]) -> list[str]:
    return [c for c in calls if " torch" in c and "-e " not in c]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="the script takes the GPU branch here")
def test_cpu_machine_pins_torch_beside_the_cpu_index(tmp_path):
    calls = torch_calls(run_setup(tmp_path, 0))
    assert len(calls) == 1, calls
    assert calls[0].endswith(" torch==2.13.0"), calls
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in calls[0], calls


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="the script takes the GPU branch here")
def test_unusable_cpu_index_falls_back_to_the_pinned_version(tmp_path):
    calls = torch_calls(run_setup(tmp_path, 1))
    assert len(calls) == 2 and "--timeout 10" in calls[0], calls
    assert calls[1].endswith(" torch==2.13.0") and "index-url" not in calls[1], calls
