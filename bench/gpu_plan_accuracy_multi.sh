#!/usr/bin/env bash
# On a lent machine with 2 or 4 GPUs: `bench plan-accuracy` over layouts of several GPUs (tp, pp with
# 1F1B and interleaved, dp with DDP and ZeRO-1, micro-batch and recomputation varied), GPT-2 medium
# (350M) to OPT-2.7B, each measured with the Trainer (one process per GPU, NCCL) against the
# planner's estimate for one node of as many GPUs. Besides the errors, the same run
#  - asks `plan search` (restricted to what the Trainer runs) for its layout of every group of
#    configurations training the same model, batch and sequence on as many GPUs, measures the picks
#    no configuration covers, and reports each pick against its group's fastest (within 5%?);
#  - measures NCCL all-reduce bus bandwidth and send/recv bandwidth over 2 (and 4) ranks, 1 to 256
#    MiB, beside the bandwidths the planner assumes for this GPU type;
#  - measures what each tensor-parallel all-reduce costs the trainer's layer over 2 (and 4) ranks
#    (train/tpcoll.py) and predicts the tp layouts with it (the result's tp_collective);
#  - predicts every row a second time with each profiled layer's forward and backward timed back to
#    back as a step issues them (the profiles' step_s, Assumptions.paired_steps): paired_s beside
#    predicted_s, and the summary's paired_* errors.
# On 4 GPUs one run holds both sets: a 2-rank configuration runs on GPUs 0 and 1 and is grouped,
# summarised (summary.by_gpus) and compared with links over 2 ranks apart from the 4-rank ones, so
# the 2- and 4-GPU results come from the same machine without running the 2-GPU set twice.
# NVLink multicast stays off. Results land in $OUT (or bench/results when OUT is unset) as
# plan_accuracy_<gpu>_x<N>[_<set>].{json,png} and the profiles beside them.
#   bash bench/gpu_plan_accuracy_multi.sh [two|four|all] [more bench plan-accuracy flags, e.g. --cuda-graphs]
# With --cuda-graphs every layout replays each micro-batch as CUDA graphs, a pipeline stage by stage
# (train/stage_graphs.py), and is predicted as such (Assumptions.graphed_steps): on two H200s the 12
# configured layouts came within 3.4% mean, 11.8% worst, memory 4.7%, and every pick was its group's
# fastest (bench/results/plan_accuracy_h200_x2_stage_graphs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-bench/results}
n=$(nvidia-smi -L | wc -l)
nvidia-smi topo -m  # the links the bandwidths below run over
slug=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' | sed 's/nvidia //; s/ .*//')
two=(gpt2-medium:8:32:1024@tp=2 gpt2-medium:8:32:1024@pp=2 gpt2-medium:4:32:1024@pp=2,v=2
     gpt2-medium:8:32:1024@dp=2 gpt2-medium:8:32:1024@dp=2,zero1 gpt2-large:4:32:1024@tp=2
     gpt2-large:4:32:1024:full@tp=2 gpt2-large:4:32:1024@pp=2 gpt2-xl:2:16:1024@pp=2
     gpt2-xl:4:16:1024:full@pp=2 opt-2.7b:2:16:1024@tp=2 opt-2.7b:4:16:1024:full@tp=2)
four=(gpt2-medium:8:64:1024@dp=4 gpt2-medium:8:64:1024@dp=4,zero1 gpt2-large:4:32:1024@tp=2,dp=2
      gpt2-large:4:32:1024@tp=4 gpt2-large:2:32:1024@pp=4 gpt2-large:2:32:1024@pp=2,v=2,dp=2
      gpt2-xl:2:32:1024@pp=2,dp=2 gpt2-xl:2:32:1024@pp=4,v=2 gpt2-xl:4:32:1024:full@pp=4
      opt-2.7b:2:32:1024@tp=4 opt-2.7b:2:32:1024@tp=2,pp=2 opt-2.7b:4:32:1024:full@tp=2,dp=2,zero1)
# SET (first argument, optional): two | four | all (default: all the machine's GPUs allow). Each set is
# a dozen trainings of a few processes each (about 20 s apiece with their start-up) plus the picks: run
# the sets in separate calls where one call's time is short; each writes its own files.
set_=${1:-all}; case $set_ in two|four|all) shift || true ;; *) set_=all ;; esac
case $set_ in
  two) configs=("${two[@]}") ;;
  four) configs=("${four[@]}") ;;
  all) configs=("${two[@]}"); [ "$n" -ge 4 ] && configs=("${two[@]}" "${four[@]}") ;;
esac
if [ "$set_" = four ] && [ "$n" -lt 4 ]; then echo "the four-GPU set needs 4 GPUs, this machine has $n" >&2; exit 2; fi
args=(); for c in "${configs[@]}"; do args+=(--config "$c"); done
tag=$([ "$set_" = all ] && echo "x${n}" || echo "x${n}_${set_}")
python3 -m computron.cli bench plan-accuracy --device cuda --out "$OUT/plan_accuracy_${slug}_${tag}" "${args[@]}" "$@"
