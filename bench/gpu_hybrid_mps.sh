#!/usr/bin/env bash
# On the lent GPU machine: bench/hybrid.py with the server and the training job as clients of one CUDA
# MPS server, so that their kernels run side by side on the SMs instead of taking turns in time
# slices (beside the job, inference's median latency doubles and a few cold-start requests miss
# their SLO: bench/results/hybrid_h200_s34/README.md). The colocated job may use TRAIN_SMS percent
# of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, its process only: the job alone keeps all of them);
# one hybrid run per value, tagged ${TAG}_mps_sm<P>.
#   TRAIN_SMS="100 50" TAG=h200 bash bench/gpu_hybrid_mps.sh --duration 25 --repeats 2 --job-timeout 90 \
#     --modes inference-alone,training-alone,colocate --fresh
# The MPS control daemon runs from pipe and log folders of its own under /tmp and is told to quit
# when the script ends (its log lands in $OUT/mps_control_${TAG}.log); the GPU's settings (compute
# mode and the rest) are left as they are. Compare with the same flags without MPS in the same call.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
command -v nvidia-cuda-mps-control > /dev/null || { echo "no nvidia-cuda-mps-control here: MPS cannot run on this machine" >&2; exit 2; }
for p in ${TRAIN_SMS:-100 50}; do  # CUDA takes a whole percentage of the SMs, 1 to 100
  [[ $p =~ ^[0-9]+$ ]] && [ "$p" -ge 1 ] && [ "$p" -le 100 ] || { echo "TRAIN_SMS takes percentages from 1 to 100, got '$p'" >&2; exit 2; }
done
OUT=${OUT:-bench/results}
TAG=${TAG:-h200}
mkdir -p "$OUT"
CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/computron-mps-pipe.XXXXXX)
CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/computron-mps-log.XXXXXX)
export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d || { echo "the MPS control daemon did not start" >&2; exit 1; }
trap 'echo quit | nvidia-cuda-mps-control; cp "$CUDA_MPS_LOG_DIRECTORY/control.log" "$OUT/mps_control_$TAG.log" 2> /dev/null' EXIT
rc=0
for p in ${TRAIN_SMS:-100 50}; do
  python3 bench/hybrid.py --out "$OUT" --tag "${TAG}_mps_sm$p" \
    --colocated-job-env "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$p" "$@" || rc=$?
done
exit $rc
