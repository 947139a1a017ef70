#!/usr/bin/env bash
# Here, before runs on a GPU machine that cannot reach a package index: download into .whl/ the wheels
# of the server's packages (FastAPI, uvicorn, pydantic and everything they need), at the versions this
# checkout's .venv has, for the GPU machine's Python (GPU_PYTHON, default 3.12; x86-64 Linux).
# bench/gpu_env.sh installs them there when the machine lacks FastAPI. Carry .whl with the run.
#   bash bench/gpu_wheels.sh && ls .whl
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${GPU_PYTHON:-3.12}
[ -x .venv/bin/python ] || { echo "gpu_wheels.sh: no .venv here; run scripts/setup.sh first (its versions are the ones downloaded)" >&2; exit 2; }
PINS=$(.venv/bin/python - <<'PY'
from importlib.metadata import version
print(" ".join(f"{p}=={version(p)}" for p in ("fastapi", "uvicorn", "pydantic")))
PY
)
mkdir -p .whl
# shellcheck disable=SC2086
python3 -m pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl $PINS
echo "gpu_wheels.sh: $(ls .whl | wc -l) wheels in .whl for Python $PYVER ($PINS)"
