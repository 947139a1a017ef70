#!/usr/bin/env bash
# On the lent GPU machine: bench/gpu_slo.sh on the traces of several seeds, the default policy one
# model a step and the slo policy three, every run of one seed on the same trace. A 99% point needs
# several traces pooled (bench/results/preempt_gpu_h200_seeds/README.md). Each seed's runs are written into
# one archive, $OUT/slo_seed<seed>_<time>.tgz: a lent machine sends back only a few files, and no deep
# folders. About 85 s a run of 60 s; fit SEEDS x (DEFAULT_RATES + SLO_RATES) runs into one call.
#   SEEDS="4 5" DEFAULT_RATES="4 5" SLO_RATES="8 9" SLO_CAL=... bash bench/gpu_slo_seeds.sh
# Then, here: for f in slo_seed*.tgz; do tar xzf $f -C bench/results/<folder>; done, and
#   python3 bench/preempt_gpu_report.py bench/results/<folder> --simulate <calibration>
# (DURATION, START, BUDGET, SLO_CAL and PORT pass through to bench/gpu_slo.sh.)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DEST=${OUT:-bench/results/preempt_gpu_seeds}
mkdir -p "$DEST"
for s in ${SEEDS:-1 2}; do  # one archive a seed, written as soon as its runs end: a call cut short keeps the rest
  WORK=$(mktemp -d)
  SEED=$s OUT=$WORK/seed$s/mps1 MPS=1 POLICIES=default RATES="${DEFAULT_RATES:-4 5}" bash "$HERE/gpu_slo.sh"
  SEED=$s OUT=$WORK/seed$s/mps3 MPS=3 POLICIES=slo RATES="${SLO_RATES:-8 9}" bash "$HERE/gpu_slo.sh"
  find "$WORK" -name '*.png' -delete
  tar czf "$DEST/slo_seed${s}_$(date +%s).tgz" -C "$WORK" . && rm -rf "$WORK"
done
ls -la "$DEST"
