#!/usr/bin/env bash
# On the lent GPU machine: GPU tests, then `bench swap` on OPT-1.3B, OPT-13B and Llama-3-8B.
# Results land in $OUT (or bench/results when OUT is unset).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
OUT=${OUT:-bench/results}
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tail -15
python3 -m computron.bench swap opt-1.3b --repeats 5 --out "$OUT/swap_opt-1.3b.json"
python3 -m computron.bench swap opt-13b --repeats 5 --decode-tokens 0 --out "$OUT/swap_opt-13b.json"
python3 -m computron.bench swap llama-3-8b --repeats 3 --out "$OUT/swap_llama-3-8b.json"
