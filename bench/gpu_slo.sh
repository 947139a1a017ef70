#!/usr/bin/env bash
# On the lent GPU machine: the slo policy against the default one on the real server, same trace.
#   bash bench/gpu_slo.sh            (about 3 minutes a rate; RATES, DURATION, SEED, START, SHAPE, BUDGET,
#                                     SLO_CAL, PORT, POLICIES and MPS override the defaults; START=arrival
#                                     makes the traces as before 2026-11-29: see workload/arrivals.py)
# Six OPT-1.3B-shaped models on one GPU under a 10.5 GiB budget (at most three resident): `hot` takes
# 10/15 of the requests, c1..c5 1/15 each, Gamma CV 2, prompts 32-512 and outputs 16-256 tokens, as
# the simulator's hot/cold sweep (bench/results/preempt/README.md). Per total rate (RATES, requests/s,
# default "10") and policy: `serve`, then `loadgen --trace` (JSON and plots under $OUT/rate_<R>, default
# OUT bench/results/preempt_gpu).
# SLO_CAL (a calibration file; made by `bench calibrate --serve` on this GPU when it does not exist):
# the slo policy is told the SLO loadgen measures, as `computron sim` tells it: each model's latency
# within 5x its solo latency, the solo latency from that calibration (the server's default otherwise:
# 5x the built-in calibration's prefill and decode step).
# MPS (default 1): the engine's models_per_step, the decode batches of different models one step runs
# together on the GPU. POLICIES (default "default slo"): the policies run at each rate.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
OUT=${OUT:-bench/results/preempt_gpu}
mkdir -p "$OUT"
PORT=${PORT:-8101}  # the server's port (another for each run side by side on one machine)
SHAPE=${SHAPE:-opt-1.3b}
NAMES=(hot c1 c2 c3 c4 c5)
M=""; for m in "${NAMES[@]}"; do M="$M --model $SHAPE=$m"; done
if [ -n "${SLO_CAL:-}" ] && [ ! -f "$SLO_CAL" ]; then $C bench calibrate --serve --prompt 32 128 512 2000 --out "$SLO_CAL"; fi
for R in ${RATES:-10}; do
  D="$OUT/rate_$R"; mkdir -p "$D"
  TRACE="$D/trace.jsonl"
  python3 -c "
from computron.workload import make_workload
r = $R / 15
make_workload(['hot', 'c1', 'c2', 'c3', 'c4', 'c5'], rate=None, rates=[10 * r] + [r] * 5, duration=${DURATION:-60},
              cv=2.0, prompt=(32, 512), output=(16, 256), seed=${SEED:-1}, start='${START:-stationary}').write_jsonl('$TRACE')"
  SLOS=""
  if [ -n "${SLO_CAL:-}" ]; then
    SLOS=$(python3 -c "
from computron.config import EngineConfig, ModelSpec
from computron.sim.costs import calibration
from computron.sim.run import Simulation
from computron.workload.trace import Trace
specs = [ModelSpec.parse('$SHAPE=' + n) for n in '${NAMES[*]}'.split()]
solo = Simulation(specs, calibration('$SLO_CAL'), EngineConfig(device='cpu')).solo_latency(Trace.read_jsonl('$TRACE'))
print('  slos:'); [print(f'    {n}: {{latency_s: {5 * s:.4f}}}') for n, s in solo.items()]")
  fi
  for policy in ${POLICIES:-default slo}; do
    printf 'engine:\n  policy: %s\n  max_loaded: 3\n  gpu_memory_budget: %s\n  models_per_step: %s\n' "$policy" "${BUDGET:-10.5GiB}" "${MPS:-1}" > /tmp/slo_${policy}_$PORT.yaml
    [ "$policy" = slo ] && [ -n "$SLOS" ] && echo "$SLOS" >> /tmp/slo_${policy}_$PORT.yaml
    $C serve --config /tmp/slo_${policy}_$PORT.yaml $M --port $PORT --log-level warning > "$D/serve_$policy.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
    $C loadgen --url http://127.0.0.1:$PORT --trace "$TRACE" --out "$D/measured_$policy.json" --plots "$D/plots_$policy" | tail -3
    curl -s http://127.0.0.1:$PORT/metrics | grep -E "^computron_(slo|preempt|run_ahead|shared_steps|engine_step)" > "$D/metrics_$policy.txt"
    kill -INT $pid; wait $pid
  done
done
