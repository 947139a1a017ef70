#!/usr/bin/env bash
# Optional: compile the simulator's hot path (scheduler, engine core, simulated executor; see
# src/computron/_fast.py) with mypyc into build/fast, for ~3.5x the simulated requests per second.
# Nothing depends on it: the Python modules always stay, and run unless COMPUTRON_COMPILED=1 is set
# (then only a build made from the current sources is loaded). Needs a C compiler and mypy, e.g.
#   python -m venv /tmp/mypyc && /tmp/mypyc/bin/pip install mypy
#   MYPYC_PYTHON=/tmp/mypyc/bin/python scripts/build_fast.sh
# MYPYC_PYTHON: an interpreter with mypy, the same Python version as PYTHON (default .venv/bin/python),
# which runs the check at the end. Without a compiler or mypy it says so and exits 0 (nothing built).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
MYPYC_PY=${MYPYC_PYTHON:-$PY}
if ! command -v "${CC:-cc}" >/dev/null 2>&1; then
  echo "build_fast.sh: no C compiler (${CC:-cc}); nothing built, the Python modules run" >&2
  exit 0
fi
if ! "$MYPYC_PY" -c "import mypyc" 2>/dev/null; then
  echo "build_fast.sh: $MYPYC_PY has no mypy (pip install mypy, or set MYPYC_PYTHON); nothing built" >&2
  exit 0
fi
mine=$("$PY" -c "import importlib.machinery as m; print(m.EXTENSION_SUFFIXES[0])")
theirs=$("$MYPYC_PY" -c "import importlib.machinery as m; print(m.EXTENSION_SUFFIXES[0])")
if [ "$mine" != "$theirs" ]; then
  echo "build_fast.sh: $MYPYC_PY builds $theirs modules, $PY loads $mine; use the same Python version" >&2
  exit 1
fi
"$MYPYC_PY" scripts/build_fast.py "$@"
COMPUTRON_COMPILED=1 PYTHONPATH=src "$PY" -W error::RuntimeWarning -c "
import computron.sim, computron.engine.core
from computron import _fast
got = _fast.compiled_modules()
assert sorted(got) == sorted(_fast.MODULES), got
print(f'build_fast.sh: {len(got)} modules compiled; COMPUTRON_COMPILED=1 runs them')"
