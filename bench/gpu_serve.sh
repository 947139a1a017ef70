#!/usr/bin/env bash
# On the lent GPU machine: `bench serve`, the HTTP path against the
# engine's own API on one workload. Results land in $OUT (or bench/results when OUT is unset).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
OUT=${OUT:-bench/results}
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tail -5
# 4 copies of OPT-1.3B under a budget that holds two of them; 2 copies of OPT-13B, one fits.
$C bench serve --model opt-1.3b -n 4 -c 1 -r 32 --repeat 3 --gpu-memory-budget 8GiB --out "$OUT/serve_opt-1.3b_c1.json"
$C bench serve --model opt-1.3b -n 4 -c 8 -r 96 --rate 20 --gpu-memory-budget 8GiB --out "$OUT/serve_opt-1.3b_c8.json"
$C bench serve --model opt-13b -n 2 -c 1 -r 12 --repeat 2 --gpu-memory-budget 40GiB --out "$OUT/serve_opt-13b_c1.json"
