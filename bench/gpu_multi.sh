#!/usr/bin/env bash
# On a lent machine with 4 GPUs (kind nvidia-h200-x4): the model-parallel runs.
#  1. aggregate swap-in of OPT-13B at tp=1, 2, 4 and pp=2, 4 against a raw pinned memcpy of every
#     rank's shard on its own GPU at once (each repeat timed by its slowest rank);
#  2. the original Computron experiment (round-robin, 2 copies of OPT-13B, 24 blocking requests) at
#     (tp, pp) = (1,1), (2,1), (4,1), (1,2), (1,4), (2,2), both policies in the same run.
# Results land in $OUT (or bench/results when OUT is unset). NVLink multicast stays off.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
C="python3 -m computron.cli"
for l in "1 1" "2 1" "4 1" "1 2" "1 4"; do
  set -- $l
  $C bench swap opt-13b --tp $1 --pp $2 --repeats 5 --decode-tokens 0 --out "$OUT/swap_opt-13b_tp$1_pp$2.json" | tail -4
done
for l in "1 1" "2 1" "4 1" "1 2" "1 4" "2 2"; do
  set -- $l
  $C bench round-robin opt-13b -n 2 -r 24 --blocking --tp $1 --pp $2 \
    --out "$OUT/round_robin_opt-13b_tp$1_pp$2_n2_r24_blocking.json" | tail -5
done
