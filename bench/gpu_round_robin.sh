#!/usr/bin/env bash
# On the lent GPU machine: the round-robin swap test, OPT-13B, 2 copies, 24 blocking requests,
# both policies in one run. Results land in $OUT (or bench/results when OUT is unset).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
OUT=${OUT:-bench/results}
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tail -5
python3 -m computron.bench round-robin opt-13b -n 2 -r 24 --blocking --out "$OUT/round_robin_opt-13b_n2_r24_blocking.json"
