#!/usr/bin/env bash
# Set up a virtual environment in .venv with Computron and its dependencies.
#   scripts/setup.sh          runtime dependencies
#   scripts/setup.sh --test   plus the test tools (transformers, openai, pytest, hypothesis)
# Without an NVIDIA GPU, torch comes from PyTorch's CPU-only wheel index: from the default index
# torch depends on several GB of CUDA libraries that a CPU-only machine cannot use. When that index
# cannot be reached within a few seconds, the default index is used instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" torch
  else
    CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
    if "${PIP[@]}" --timeout 10 --retries 0 --index-url "$CPU_INDEX" torch; then
      :
    else
      echo "setup.sh: $CPU_INDEX could not be used; installing torch from the default index" >&2
      "${PIP[@]}" torch
    fi
  fi
fi
if [ "${1:-}" = "--test" ]; then
  "${PIP[@]}" -e ".[test]"
else
  "${PIP[@]}" -e .
fi
