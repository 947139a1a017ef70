#!/usr/bin/env bash
# On the lent GPU machine: the original Computron simulation's presets, scaled to what one GPU holds,
# measured against `computron serve` and simulated from this GPU's calibration, both policies, same run.
#   bash bench/gpu_sim_presets.sh [PRESET ...]   (default: all six; about 2 minutes each)
# Presets (`computron sim --help`): N copies of one model (SHAPE, default opt-1.3b), the budget holding
# R of them as `computron sim --preset` sets it; rates as named; Gamma arrivals with CV (default 1) for
# DURATION seconds (default 30; each stream stationary from 0, START=arrival as before 2026-11-29),
# prompts and outputs of 128 tokens. Per preset and policy: `serve` +
# `loadgen --trace` (measured), then `sim --trace --loadgen-probes` from the policy's calibration
# (made once by `bench calibrate` and reused: calibration_gpu[_legacy].json under $CAL_DIR, by default
# $OUT, as bench/gpu_sim_validate.sh makes them; CAL_DIR=bench/results/sim_validate reuses the H200's).
# Afterwards `python3 bench/sim_presets_report.py $OUT/presets` tabulates mean and p99 latency, measured
# and simulated, and the default policy's gain over computron's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
CAL_DIR=${CAL_DIR:-$OUT}
R="$OUT/presets"
mkdir -p "$R"
C="python3 -m computron.cli"
PORT=${PORT:-8100}  # the server's port (another for each run side by side on one machine)
SHAPE=${SHAPE:-opt-1.3b}
CV=${CV:-1}
DURATION=${DURATION:-30}
presets=("$@"); [ ${#presets[@]} -gt 0 ] || presets=(3m-1-1-1 3m-10-1-1 3m-10-10-1 6m-1x6 6m-10-10-1-1-1-1 6m-10x4-1-1)
for preset in "${presets[@]}"; do
  # the preset's models, budget, models resident and rates, as `computron sim --preset` sets them
  read -r MODELS BUDGET RESIDENT RATES < <(python3 -c "
import argparse
from computron.sim.cli import _setup
ns = argparse.Namespace(preset='$preset', models='$SHAPE', budget=None, rate=None, rates=None, trace=None)
specs, kw = _setup(ns)
print(','.join(f'{s.source}={s.alias}' for s in specs), kw['gpu_memory_budget'], kw['max_loaded'], ns.rates)
") || { echo "unknown preset $preset" >&2; exit 2; }
  trace="$R/${preset}_cv${CV}.jsonl"
  python3 -c "
from computron.workload import make_workload
names = [m.split('=')[1] for m in '$MODELS'.split(',')]
make_workload(names, rate=None, rates=[float(r) for r in '$RATES'.split(',')], duration=$DURATION, cv=$CV,
              prompt=128, output=128, seed=1, start='${START:-stationary}').write_jsonl('$trace')"
  echo "== $preset: $MODELS, budget $BUDGET, $RESIDENT resident, rates $RATES, CV $CV ($(wc -l < "$trace") requests)"
  for policy in default computron; do
    if [ "$policy" = computron ]; then EXE="--executor legacy"; CAL="$CAL_DIR/calibration_gpu_legacy.json"; else EXE=""; CAL="$CAL_DIR/calibration_gpu.json"; fi
    [ -f "$CAL" ] || $C bench calibrate $EXE --prompt 32 128 512 2000 --out "$CAL"
    printf 'engine:\n  policy: %s\n  max_loaded: %s\n  gpu_memory_budget: %s\n  workspace_bytes: 2GiB\n' \
      "$policy" "$RESIDENT" "$BUDGET" > "/tmp/presets_${policy}_$PORT.yaml"
    flags=(); for m in ${MODELS//,/ }; do flags+=(--model "$m"); done
    $C serve --config "/tmp/presets_${policy}_$PORT.yaml" "${flags[@]}" --port $PORT --log-level warning > "/tmp/serve_${policy}_$PORT.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
    tag="${preset}_cv${CV}_$policy"
    $C loadgen --url http://127.0.0.1:$PORT --trace "$trace" --out "$R/measured_$tag.json" | tail -4
    # the engine's own counts (swap-ins, steps, preemptions, prefill tokens) beside the simulator's
    curl -sf http://127.0.0.1:$PORT/metrics | grep -E '^computron_(swap_ins|evictions|engine_steps|preemptions|pauses|prefill_tokens|swap_in_seconds)' \
      > "$R/metrics_$tag.txt"
    kill -INT $pid; wait $pid
    $C sim --preset "$preset" --models "$SHAPE" --trace "$trace" --policy "$policy" --calibration "$CAL" \
        --loadgen-probes --out "$R/sim_$tag.json" | tail -4
  done
done
