#!/usr/bin/env bash
# Set up a virtual environment in .venv with Computron and its dependencies.
#   scripts/setup.sh          runtime dependencies
#   scripts/setup.sh --test   plus the test tools (transformers, openai, pytest, hypothesis)
# Without an NVIDIA GPU, torch is pinned to a CPU build (a plain `pip install torch` would pull
# several GB of CUDA packages that a CPU-only machine cannot use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" torch
  else
    "${PIP[@]}" torch==2.13.0
  fi
fi
if [ "${1:-}" = "--test" ]; then
  "${PIP[@]}" -e ".[test]"
else
  "${PIP[@]}" -e .
fi
