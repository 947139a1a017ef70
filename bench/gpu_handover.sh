#!/usr/bin/env bash
# On the lent GPU machine, in one call: colocation's two targets in one configuration. The job under
# PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (a handover trims the memory pool to the limit) with a
# run-ahead bound of RUN_AHEAD watched points and a fence every FENCE_EVERY (defaults 8 and 4, computron
# train's; both targets met with first-token yields, bench/results/handover_h200_s42/README.md):
#   1. the handover on its own: bench/colocate_release.py, unbounded against the bound, 2.45 GiB demands
#      (target: free within 20 ms at p99);
#   2. the four-model workload under CUDA MPS (bench/gpu_hybrid_mps.sh, the s39 setting), the colocated
#      job with the same bound and allocator, yielding until first tokens (targets: >= 80% of training
#      alone, attainment within 1 point of inference alone, above task-switch and the static splits).
# About 9 minutes on an H200. Results under $OUT, tagged ${TAG}_*.
#   TAG=h200 bash bench/gpu_handover.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
OUT=${OUT:-bench/results}
TAG=${TAG:-h200}
RA=${RUN_AHEAD:-8}
K=${FENCE_EVERY:-4}
ASYNC=backend:cudaMallocAsync
mkdir -p "$OUT"
rc=0
PYTORCH_CUDA_ALLOC_CONF=$ASYNC timeout 240 python3 bench/colocate_release.py --run-ahead "0,$RA" --fence-every "$K" \
  --demand-gb 2.45 --rounds 3 --handovers 10 --window 6 --out "$OUT" --tag "${TAG}_async_ra${RA}_${K}" \
  > "$OUT/colocate_release_${TAG}_async_ra${RA}_${K}.log" 2>&1 || rc=$?
tail -12 "$OUT/colocate_release_${TAG}_async_ra${RA}_${K}.log"
TRAIN_SMS=100 TAG="${TAG}_four_async_ra${RA}_${K}" timeout 420 bash "$(dirname "$0")/gpu_hybrid_mps.sh" \
  --duration 25 --repeats 2 --job-timeout 60 --fresh \
  --modes inference-alone,training-alone,colocate+yield-first,static@14.5,static@16.5,task-switch \
  --colocated-job-env "PYTORCH_CUDA_ALLOC_CONF=$ASYNC" \
  "--train-args=--colocate-run-ahead $RA --colocate-fence-every $K" \
  > "$OUT/hybrid_${TAG}_four_async_ra${RA}_${K}.log" 2>&1 || rc=$?
tail -8 "$OUT/hybrid_${TAG}_four_async_ra${RA}_${K}.log"
exit $rc
