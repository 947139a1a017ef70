#!/usr/bin/env bash
# On the lent GPU machine: the simulator checked against the real server on one trace.
#   bench/gpu_sim_validate.sh [default|computron|all]   (default: all; each policy is ~4 minutes)
# 1. `bench calibrate` measures swap, prefill and decode on this GPU, for each policy's executor
#    (default: in-process; computron: legacy), twice: on the engine alone, and (--serve) through
#    the HTTP server with loadgen's streamed client; each is made once and reused if present;
# 2. one trace: three OPT-1.3B-shaped models, a budget that holds two, Gamma CV 2, 120 s (made only where
#    $TRACE is not there yet; START=arrival makes it as before 2026-11-29);
# 3. per policy: `serve` + `loadgen --trace` (measured; MEASURE=0 keeps a measurement already there),
#    then `sim --trace` from each of its two calibrations (simulated: validate_sim_<policy>.json and
#    validate_sim_<policy>_served.json), all writing JSON and plots under $OUT (or bench/results).
#    The simulation starts as loadgen leaves the server (`--loadgen-probes`: its solo-latency probes
#    first, so the models they leave resident, and the legacy executor's page-locked host copies, are
#    the trace's start); the legacy calibration also times the first (pageable) swap-in and the
#    eviction that allocates page-locked host memory (bench/results/sim_validate_h100/README.md).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
OUT=${OUT:-bench/results}
PORT=${PORT:-8100}  # the server's port (another for each run side by side on one machine)
WHICH=${1:-all}
TRACE="$OUT/validate_trace.jsonl"
SHAPE=${SHAPE:-opt-1.3b}
MODELS="$SHAPE=a,$SHAPE=b,$SHAPE=c"
BUDGET=${BUDGET:-8GiB}  # two OPT-1.3B images (2.6 GB each) and their KV cache; the third must swap
# prompts up to 2,000 tokens: the trace's prefill steps batch several prompts, up to ~2,000 tokens a step
CALIBRATE_ARGS=${CALIBRATE_ARGS:---prompt 32 128 512 2000}
[ -f "$TRACE" ] || python3 -c "
from computron.workload import make_workload
make_workload(['a', 'b', 'c'], rate=${RATE:-4.0}, duration=${DURATION:-120}, cv=2.0, prompt=(32, 512), output=(16, 256),
              seed=1, start='${START:-stationary}').write_jsonl('$TRACE')"
for policy in default computron; do
  [ "$WHICH" = all ] || [ "$WHICH" = "$policy" ] || continue
  if [ "$policy" = computron ]; then EXE="--executor legacy"; CAL="$OUT/calibration_gpu_legacy"; else EXE=""; CAL="$OUT/calibration_gpu"; fi
  [ -f "$CAL.json" ] || $C bench calibrate $EXE $CALIBRATE_ARGS --out "$CAL.json"
  [ -f "${CAL}_served.json" ] || $C bench calibrate $EXE --serve $CALIBRATE_ARGS --out "${CAL}_served.json"
  if [ "${MEASURE:-1}" = 1 ] || [ ! -f "$OUT/validate_measured_$policy.json" ]; then
    printf 'engine:\n  policy: %s\n  max_loaded: 2\n  gpu_memory_budget: %s\n' "$policy" "$BUDGET" > /tmp/validate_${policy}_$PORT.yaml
    $C serve --config /tmp/validate_${policy}_$PORT.yaml --model $SHAPE=a --model $SHAPE=b --model $SHAPE=c \
        --port $PORT --log-level warning > "/tmp/serve_${policy}_$PORT.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
    $C loadgen --url http://127.0.0.1:$PORT --trace "$TRACE" --out "$OUT/validate_measured_$policy.json" \
        --plots "$OUT/validate_plots/measured_$policy"
    kill -INT $pid; wait $pid
    tail -3 "/tmp/serve_${policy}_$PORT.log"
  fi
  for kind in "" _served; do
    $C sim --models "$MODELS" --trace "$TRACE" --budget "$BUDGET" --policy "$policy" --max-loaded 2 \
        --calibration "$CAL$kind.json" --loadgen-probes --out "$OUT/validate_sim_$policy$kind.json" \
        --plots "$OUT/validate_plots/sim_$policy$kind"
  done
done
