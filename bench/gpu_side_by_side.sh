#!/usr/bin/env bash
# On a lent machine with several GPUs: one-GPU benchmarks side by side, one GPU each.
#   bash bench/gpu_side_by_side.sh 'NAME=COMMAND' ['NAME=COMMAND' ...]   (at most one per GPU)
# The i-th command runs on GPU i alone (CUDA_VISIBLE_DEVICES) and on its own equal slice of the CPUs
# (taskset), with OUT=$OUT/NAME and its output in $OUT/NAME.log, under TIME_LIMIT seconds (default 560);
# then $OUT/side_by_side.json says what ran where, how long and how it ended. The GPUs are separate, the
# host is not: host memory bandwidth is shared, so a swap that overlaps another job's swap can be slower
# than on a machine of its own (four concurrent pinned copies move 3.5x one link's bytes per second on
# four H200s, bench/results/multi_h200x4/striped_swap.json, not 4x). Report results so.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-bench/results}
n=$(nvidia-smi -L | wc -l)
[ $# -ge 1 ] && [ $# -le "$n" ] || { echo "give 1 to $n 'NAME=COMMAND' arguments (one per GPU), got $#" >&2; exit 2; }
for job in "$@"; do
  case $job in [A-Za-z0-9_-]*=?*) ;; *) echo "not NAME=COMMAND (NAME of letters, digits, _ or -): $job" >&2; exit 2 ;; esac
done
allowed=($(python3 -c "import os; print(*sorted(os.sched_getaffinity(0)))"))  # the CPUs this run may use
cpus=${#allowed[@]}; per=$((cpus / n))
i=0; pids=(); names=()
for job in "$@"; do
  name=${job%%=*}; cmd=${job#*=}
  mkdir -p "$OUT/$name"
  mine=$(IFS=,; echo "${allowed[*]:$((i * per)):$per}")
  (
    start=$(date +%s)
    CUDA_VISIBLE_DEVICES=$i OUT="$OUT/$name" timeout "${TIME_LIMIT:-560}" taskset -c "$mine" bash -c "$cmd" \
      > "$OUT/$name.log" 2>&1
    rc=$?
    printf '{"name": "%s", "gpu": %d, "cpus": "%s", "rc": %d, "seconds": %d, "command": %s}\n' \
      "$name" "$i" "$mine" "$rc" "$(( $(date +%s) - start ))" \
      "$(python3 -c 'import json, sys; print(json.dumps(sys.argv[1]))' "$cmd")" > "$OUT/$name.status.json"
  ) &
  pids+=($!); names+=("$name"); i=$((i + 1))
done
wait "${pids[@]}"
python3 -c "
import json, sys
rows = [json.load(open(f'$OUT/{n}.status.json')) for n in sys.argv[1:]]
json.dump({'gpu': '$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)', 'gpus': $n, 'cpus': $cpus, 'jobs': rows},
          open('$OUT/side_by_side.json', 'w'), indent=1)
for r in rows: print(r['name'], 'rc', r['rc'], f\"{r['seconds']:.0f} s\")" "${names[@]}"
