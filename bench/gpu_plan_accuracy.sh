#!/usr/bin/env bash
# On the lent GPU machine: `bench plan-accuracy` (GPT-2-shaped training configurations measured with the
# Trainer against the planner's one-GPU estimate). Results land in $OUT (or bench/results when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
slug=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' | sed 's/nvidia //; s/ .*//')
python3 -m computron.cli bench plan-accuracy --device cuda --out "$OUT/plan_accuracy_${slug}" "$@"
