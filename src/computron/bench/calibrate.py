"""``computron bench calibrate MODEL...``: measure what ``computron sim`` needs on this device.

For each model (resident alone on the device, through the real engine):

- swap-in: offload, then load and wait for its copies (the engine's own path), median of
  ``--repeats``; eviction the same way. Bandwidth = image bytes / swap-in seconds;
- prefill: one request of P prompt tokens and one new token, for each P of ``--prompt``;
- decode: B requests decoding together, step time = (last token − first token) / (tokens − 1), for
  each B of ``--batch`` (as ``bench decode``);
- the weight-read floor (one pass over the model's bytes), which bounds every step from below.

The simulator's cost terms are fitted by least squares over all models at once (two or more
model sizes separate the per-byte terms from the fixed ones): prefill = a + a'·bytes + P·(b + c·bytes),
decode = d + d'·bytes + B·(e + f·bytes), each at least bytes / HBM rate. Writes the calibration file that
``computron sim --calibration FILE`` reads, and beside it (``.points.json``) every measured point
with the fit's prediction and error.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np


def _fit(rows: list[tuple[float, float, float]]) -> tuple[float, float, float, float]:
    """Non-negative least squares of t = x0 + x1·bytes + n·(x2 + x3·bytes) over (bytes, n, t): the
    best unconstrained fit, over the subsets of the four terms, whose coefficients are all
    non-negative (fifteen subsets); relative errors weighted alike."""
    from itertools import combinations

    cols = np.array([[1.0, b, n, n * b] for b, n, _ in rows])
    t = np.array([t for _, _, t in rows])
    w = 1.0 / t  # relative error: small steps count as much as large ones
    scale = np.abs(cols).max(axis=0)  # bytes are ~1e9: columns scaled for a well-conditioned solve
    scale[scale == 0] = 1.0  # a column of zeros (no tokens: evictions) stays zero
    best, best_err = (0.0, 0.0, 0.0, 0.0), np.inf
    for k in (1, 2, 3, 4):
        for subset in combinations(range(4), k):
            a = cols[:, subset] / scale[list(subset)] * w[:, None]
            x, *_ = np.linalg.lstsq(a, t * w, rcond=None)
            if (x < 0).any():
                continue
            err = float(np.sum((a @ x - t * w) ** 2))
            if err < best_err * (1 - 1e-9):
                full = [0.0] * 4
                for i, v in zip(subset, x):
                    full[i] = float(v / scale[i])
                best, best_err = tuple(full), err
    return best


def run(models: list[str], device: str, batches: list[int], prompts: list[int], new: int, repeats: int,
        budget: str | None, executor: str | None = None) -> dict:
    import torch

    from ..config import EngineConfig, ModelSpec
    from ..engine import Engine, SamplingParams
    from ..sim.costs import Calibration, batch_time
    from .common import machine
    from .decode import _engine_step_s, _floor_s

    eng = Engine(EngineConfig(device=device, gpu_memory_budget=budget, executor=executor))
    dev = eng.executor.device if hasattr(eng.executor, "device") else torch.device("cpu")
    points = {"swap": [], "evict": [], "prefill": [], "decode": [], "floor": []}
    rng = np.random.default_rng(0)
    for name in models:
        spec = ModelSpec.parse(name)
        eng.register_model(spec)
        nbytes = eng.core.models[spec.name].total_bytes
        vocab = eng.core.models[spec.name].config.vocab_size
        for _ in range(repeats + 1):  # the first round warms the path up
            eng.core.offload(spec.name)
            t0 = time.perf_counter()
            eng.core.load(spec.name, wait=True)
            swap = time.perf_counter() - t0
            t0 = time.perf_counter()
            eng.core.offload(spec.name)
            evict = time.perf_counter() - t0
            points["swap"].append((spec.name, nbytes, swap))
            points["evict"].append((spec.name, nbytes, evict))
        del points["swap"][-repeats - 1], points["evict"][-repeats - 1]
        eng.core.load(spec.name, wait=True)
        greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for p in prompts:
            times = []
            for _ in range(repeats + 1):
                ids = rng.integers(0, vocab, p).tolist()
                t0 = time.perf_counter()
                req = eng.submit(spec.name, ids, greedy)
                eng.run_until_done([req])
                times.append(req.first_token_at - t0)
            points["prefill"].append((spec.name, nbytes, p, statistics.median(times[1:])))
        plen = min(prompts)
        for b in batches:
            prompt_ids = [rng.integers(0, vocab, plen).tolist() for _ in range(b)]
            _engine_step_s(eng, spec.name, b, prompt_ids, new)  # warm-up (graph capture for this batch)
            step = statistics.median(_engine_step_s(eng, spec.name, b, prompt_ids, new) for _ in range(repeats))
            points["decode"].append((spec.name, nbytes, b, step))
        points["floor"].append((spec.name, nbytes, _floor_s(nbytes, dev)))
        eng.core.offload(spec.name)
    swap_bw = statistics.median(b / s for _, b, s in points["swap"])
    hbm = statistics.median(b / s for _, b, s in points["floor"])
    pf = _fit([(b, p, t) for _, b, p, t in points["prefill"]])
    dc = _fit([(b, n, t) for _, b, n, t in points["decode"]])
    ev = _fit([(b, 0, t) for _, b, t in points["evict"]])  # fixed + per byte (a copy back, if any)
    mem = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else \
        eng.executor.status().devices[0].budget
    cal = Calibration(name=f"measured:{machine().get('gpu', dev.type)}", swap_bandwidth=(swap_bw,), hbm_bandwidth=hbm,
                      prefill_fixed_s=pf[0], prefill_fixed_s_per_byte=pf[1], prefill_token_s=pf[2],
                      prefill_token_s_per_byte=pf[3], decode_fixed_s=dc[0], decode_fixed_s_per_byte=dc[1],
                      decode_seq_s=dc[2], decode_seq_s_per_byte=dc[3],
                      evict_s=ev[0], evict_s_per_byte=ev[1], device_memory=int(mem))
    checks = []
    for kind in ("prefill", "decode"):
        for name, b, n, t in points[kind]:
            pred = batch_time(cal, b, n, 0) if kind == "prefill" else batch_time(cal, b, 0, n)
            checks.append({"kind": kind, "model": name, "n": n, "measured_s": t, "fit_s": pred,
                           "error": pred / t - 1})
    eng.executor.shutdown()
    return {"calibration": cal, "points": {k: v for k, v in points.items()}, "fit": checks, "machine": machine()}


def main(args) -> int:
    from ..bench.common import print_table, write_json

    if not args.model:
        import torch

        gpu = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
        args.model = ["opt-125m", "opt-350m", "opt-1.3b"] if gpu else ["tiny-gpt2", "tiny-opt", "tiny-llama"]
    import sys

    try:
        res = run(args.model, args.device, args.batch, args.prompt, args.new_tokens, args.repeats,
                  args.gpu_memory_budget, args.executor)
    except (ValueError, FileNotFoundError, MemoryError) as e:  # EngineError is a ValueError
        print(f"computron bench calibrate: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    cal = res.pop("calibration")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cal.save(out)
    write_json(out.with_suffix(".points.json"), {"calibration": cal.to_dict(), **res})
    rows = [[c["kind"], c["model"], c["n"], f"{c['measured_s'] * 1e3:.3f}", f"{c['fit_s'] * 1e3:.3f}",
             f"{c['error'] * 100:+.1f}%"] for c in res["fit"]]
    print_table("calibration: measured against the fitted cost model (ms)",
                ["kind", "model", "tokens/batch", "measured", "fit", "error"], rows)
    print(f"swap-in {cal.swap_bandwidth[0] / 1e9:.1f} GB/s, weight reads {cal.hbm_bandwidth / 1e9:.0f} GB/s, "
          f"eviction {cal.evict_s * 1e6:.0f} us + {cal.evict_s_per_byte * 1e9 * 1e3:.2f} ms/GB; "
          f"wrote {out} and {out.with_suffix('.points.json')}")
    return 0
