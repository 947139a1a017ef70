"""Does the server's per-token, per-stream cost grow with the batch? (issue 11)

One engine, one model (tiny-opt on the CPU by default), in one run, for each batch B:

- engine: B requests decoding together on the engine alone (``Engine.run_until_done``, before the
  server starts: no HTTP), step = (last token - last first token) / (tokens - 1);
- served: the same B requests streamed through the HTTP server by loadgen's client from another
  process (``bench calibrate --serve``'s path), the same step formula;
- staggered: the B streams sent 1/B of the decode apart, so requests join the batch while others stream
  (the load of a trace, not the synchronised start of a calibration).

served - engine, per stream, is the server's per-token cost at that concurrency; if it is flat in B,
a calibration whose per-sequence decode term was fitted through the server (batches 1..64) holds it.

    PYTHONPATH=src python bench/server_token_cost.py [--model tiny-opt] [--batch 1 4 16 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from computron.bench.calibrate import _Served  # noqa: E402
from computron.bench.common import machine, write_json  # noqa: E402
from computron.bench.decode import _engine_step_s  # noqa: E402
from computron.config import EngineConfig, ModelSpec  # noqa: E402
from computron.engine import Engine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-opt")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "server_token_cost_cpu.json"))
    a = ap.parse_args()
    eng = Engine(EngineConfig(device="cpu"))
    spec = ModelSpec.parse(a.model)
    eng.register_model(spec)
    vocab = eng.core.models[spec.name].config.vocab_size
    rng = np.random.default_rng(0)
    torch.set_num_threads(1)  # one core for the engine, the other for the client (a 2-core host)
    eng.core.load(spec.name, wait=True)
    prompts = {b: [rng.integers(0, vocab, a.prompt).tolist() for _ in range(b)] for b in a.batch}
    engine = {}
    for b in a.batch:  # the engine alone first (on this thread: no server running yet)
        runs = [_engine_step_s(eng, spec.name, b, prompts[b], a.new_tokens) for _ in range(a.repeats + 1)]
        engine[b] = runs[1:]
    path = _Served(eng)
    rows = []
    try:
        for b in a.batch:
            eng_s, srv_s, stag_s = engine[b], [], []
            e = statistics.median(eng_s)
            for i in range(a.repeats + 1):  # the first round warms up
                s = path.decode_step_s(spec.name, prompts[b], a.new_tokens)
                gap = e * a.new_tokens / b  # stagger: B joins spread over one request's decode
                recs = path._replay([(k * gap, spec.name, a.prompt, a.new_tokens) for k in range(b)])
                if i:
                    srv_s.append(s), stag_s.append(
                        statistics.median((end - f) / (a.new_tokens - 1) for _, f, end in recs))
            e, s, st = statistics.median(eng_s), statistics.median(srv_s), statistics.median(stag_s)
            rows.append({"batch": b, "engine_step_s": e, "served_step_s": s, "served_minus_engine_s": s - e,
                         "server_per_stream_s": (s - e) / b, "staggered_tpot_s": st,
                         "engine_runs_s": eng_s, "served_runs_s": srv_s, "staggered_runs_s": stag_s})
            print(f"B={b:3d}: engine {e * 1e3:7.3f} ms  served {s * 1e3:7.3f} ms  (+{(s - e) * 1e3:6.3f} ms, "
                  f"{(s - e) / b * 1e6:6.1f} us/stream)  staggered TPOT {st * 1e3:7.3f} ms", flush=True)
    finally:
        path.close()
        eng.executor.shutdown()
    bs = np.array([r["batch"] for r in rows], float)
    for key in ("engine_step_s", "served_step_s"):
        slope, icpt = np.polyfit(bs, [r[key] for r in rows], 1)
        print(f"{key}: {icpt * 1e3:.3f} ms + B x {slope * 1e6:.1f} us")
    fit = {k: dict(zip(("per_stream_s", "fixed_s"), np.polyfit(bs, [r[k] for r in rows], 1).tolist()))
           for k in ("engine_step_s", "served_step_s")}
    write_json(a.out, {"model": a.model, "prompt": a.prompt, "new_tokens": a.new_tokens, "repeats": a.repeats,
                       "rows": rows, "linear_fit": fit, "machine": machine()})
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
