#!/usr/bin/env bash
# On the lent GPU machine: the slo policy against the default one on the real server, same trace.
#   bash bench/gpu_slo.sh            (about 4 minutes; RATE, DURATION, SHAPE, BUDGET override the defaults)
# Six OPT-1.3B-shaped models on one GPU under a 10.5 GiB budget (at most three resident): `hot` takes
# 10/15 of the requests, c1..c5 1/15 each, Gamma CV 2, prompts 32-512 and outputs 16-256 tokens, as
# the simulator's hot/cold sweep (bench/results/preempt/README.md). Per policy: `serve`, then
# `loadgen --trace` (JSON and plots under $OUT, default bench/results/preempt_gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && ! python3 -c "import fastapi" 2>/dev/null; then python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site; fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/preempt_gpu}
mkdir -p "$OUT"
C="python3 -m computron.cli"
TRACE="$OUT/trace.jsonl"
R=${RATE:-10}
python3 -c "
from computron.workload import make_workload
r = $R / 15
make_workload(['hot', 'c1', 'c2', 'c3', 'c4', 'c5'], rate=None, rates=[10 * r] + [r] * 5, duration=${DURATION:-60},
              cv=2.0, prompt=(32, 512), output=(16, 256), seed=1).write_jsonl('$TRACE')"
M=""
for m in hot c1 c2 c3 c4 c5; do M="$M --model ${SHAPE:-opt-1.3b}=$m"; done
for policy in default slo; do
  printf 'engine:\n  policy: %s\n  max_loaded: 3\n  gpu_memory_budget: %s\n' "$policy" "${BUDGET:-10.5GiB}" > /tmp/slo_$policy.yaml
  $C serve --config /tmp/slo_$policy.yaml $M --port 8101 --log-level warning > "$OUT/serve_$policy.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:8101/health > /dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
  $C loadgen --url http://127.0.0.1:8101 --trace "$TRACE" --out "$OUT/measured_$policy.json" --plots "$OUT/plots_$policy"
  curl -s http://127.0.0.1:8101/metrics | grep -E "^computron_(slo|preempt)" > "$OUT/metrics_$policy.txt"
  kill -INT $pid; wait $pid
done
