#!/usr/bin/env bash
# On a lent GPU machine (1, 2 or 4 GPUs): the trainer's CUDA graphs against its eager steps.
#   bash bench/gpu_train_graphs.sh
# 1. tests/gpu/test_train_gpu.py: graphed training equals eager training (fp32; with recomputation;
#    tp=2 over NCCL where there are 2 GPUs; each test has a time limit, as the tp=2 one hung once);
# 2. bench/train_profile.py --cuda-graphs both: one profiled step after warm-up, eager then graphed, of
#    GPT-2-large and GPT-2-medium on one GPU and at dp=2 and tp=2 where the machine has 2 GPUs, each
#    step's wall time, GPU-busy time and NCCL time beside the other's. Results in $OUT (or
#    bench/results): train_graphs_<gpu>_x<N>.json.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false
OUT=${OUT:-bench/results}
n=$(nvidia-smi -L | wc -l)
slug=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' | sed 's/nvidia //; s/ .*//')
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_train_gpu.py --timeout 300 2>&1 | tail -15
configs=(--config gpt2-large:4:32:1024 --config gpt2-medium:8:32:1024)
[ "$n" -ge 2 ] && configs+=(--config gpt2-large:4:32:1024@dp=2 --config gpt2-medium:8:32:1024@dp=2
                             --config gpt2-large:4:32:1024@tp=2)
python3 bench/train_profile.py "${configs[@]}" --cuda-graphs both --out "$OUT/train_graphs_${slug}_x${n}.json" 2>&1 \
  | grep -v "USDT\|Warning\|_warn_once"
