# Sourced by bench/gpu_*.sh on the lent GPU machine: from the repository's root, the server's
# packages installed from wheels in .whl/ where the machine lacks them (pip can reach no index
# there; bench/gpu_wheels.sh downloads them beforehand), src on PYTHONPATH, and C, the CLI.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -d .whl ] && ! python3 -c "import fastapi" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
C="python3 -m computron.cli"
