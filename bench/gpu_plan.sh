#!/usr/bin/env bash
# On the lent GPU machine: the planner's measured layer profile of GPT-2 1.5B and a one-GPU
# estimate from it (micro-batch 4), beside the roofline estimate. Results land in $OUT (or bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
C="python3 -m computron.cli"
$C plan profile --model gpt2-1.5b --mbs 1,2,4,8,16 --out "$OUT/plan_profile_h200_gpt2-1.5b.json"
for src in profile roofline; do
  extra=(); [ $src = profile ] && extra=(--profile "$OUT/plan_profile_h200_gpt2-1.5b.json")
  $C plan estimate --model gpt2-1.5b --cluster h200:1x1 --tp 1 --pp 1 --dp 1 --mbs 4 "${extra[@]}" \
     --json "$OUT/plan_estimate_gpt2-1.5b_h200_$src.json"
done
