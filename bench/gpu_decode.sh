#!/usr/bin/env bash
# On the lent GPU machine: the decode GPU tests, then `bench decode` for OPT-1.3B and Llama-3-8B at
# 1, 4 and 8 decode steps per engine call (the weight-read floor and transformers in the same run).
# Results land in $OUT (or bench/results when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_decode_gpu.py tests/gpu/test_cuda_engine.py 2>&1 | tail -8
for m in opt-1.3b llama-3-8b; do
  python3 -m computron.bench decode "$m" --batch 1 8 32 128 --decode-steps 1 4 8 --repeats 3 \
    --out "$OUT/decode_${m}_runs.json" 2>&1 | grep -v Warning
done
