#!/usr/bin/env bash
# Set up a virtual environment in .venv with Computron and its dependencies.
#   scripts/setup.sh          runtime dependencies
#   scripts/setup.sh --test   plus the test tools (transformers, openai, pytest, hypothesis)
# Without an NVIDIA GPU, a pinned torch (TORCH_CPU_VERSION, default 2.13.0) is installed with
# PyTorch's CPU-only wheel index beside the default one: a plain "torch" from the default index
# depends on several GB of CUDA libraries that a CPU-only machine cannot use, while a pinned version
# lets the CPU build ("+cpu", the higher local version) win. When that index cannot be used, the
# pinned version is asked of the configured indexes alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" torch
  else
    # A pinned version: from PyPI alone a plain "torch" is a CUDA build; pinned, the CPU index's
    # "+cpu" build (or a local one that pip's configuration names) outranks it.
    CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
    CPU_TORCH=${TORCH_CPU_VERSION:-2.13.0}
    if "${PIP[@]}" --timeout 10 --retries 0 --extra-index-url "$CPU_INDEX" "torch==$CPU_TORCH"; then
      :
    else
      echo "setup.sh: $CPU_INDEX could not be used; installing torch==$CPU_TORCH from the configured index" >&2
      "${PIP[@]}" "torch==$CPU_TORCH"
    fi
  fi
fi
if [ "${1:-}" = "--test" ]; then
  "${PIP[@]}" -e ".[test]"
else
  "${PIP[@]}" -e .
fi
