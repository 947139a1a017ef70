#!/usr/bin/env bash
# On a lent machine with 2 GPUs (kind nvidia-h200-x2): what the model-parallel runs can do there.
#  1. NCCL smoke: greedy tokens of a preset at tp=2 and pp=2 (one worker process per GPU) against tp=1;
#  2. aggregate swap-in of OPT-13B at tp=2 and pp=2, then tp=1, each against a raw pinned memcpy of
#     every rank's shard on its own GPU at once (bench swap), results under $OUT (or bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
C="python3 -m computron.cli"
for l in "1 1" "2 1" "1 2"; do
  set -- $l
  $C generate --model opt-125m --tp $1 --pp $2 --prompt "Hello there" --max-tokens 12 2>/dev/null > "$OUT/smoke_tp$1_pp$2.txt"
  echo "tp=$1 pp=$2: $(od -An -tx1 "$OUT/smoke_tp$1_pp$2.txt" | tr -d ' \n' | md5sum | cut -c1-12)"
done
for l in "2 1" "1 2" "1 1"; do
  set -- $l
  $C bench swap opt-13b --tp $1 --pp $2 --repeats 3 --decode-tokens 0 --out "$OUT/swap_opt-13b_tp$1_pp$2.json" | tail -4
done
