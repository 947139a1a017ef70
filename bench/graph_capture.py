"""What CUDA graphs of the decode step cost: capture time the first time, after a reload at the same
address (none expected) and after the weights moved; and cold time to first token with graphs on
and off (the first token comes from the prefill, which is not graphed).

    PYTHONPATH=src python bench/graph_capture.py [MODEL] [--out FILE]

One GPU. Writes bench/results/graph_capture_<model>.json and prints the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from computron.bench.common import machine, write_json  # noqa: E402
from computron.config import EngineConfig, ModelSpec  # noqa: E402
from computron.engine import Engine, SamplingParams  # noqa: E402


def captures(eng: Engine) -> tuple[int, float]:
    st = eng.executor.status().stats
    return st.get("graph_captures", 0), st.get("graph_capture_s", 0.0)


def decode(eng: Engine, model: str, tokens: int) -> tuple[int, float, float]:
    """(new captures, their seconds, the request's latency) of one request of ``tokens`` tokens."""
    n0, s0 = captures(eng)
    t0 = time.perf_counter()
    eng.generate(model, list(range(5, 133)), SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    lat = time.perf_counter() - t0
    n1, s1 = captures(eng)
    return n1 - n0, s1 - s0, lat


def cold_ttft(eng: Engine, model: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        eng.offload(model)
        t0 = time.perf_counter()
        req = eng.generate(model, list(range(5, 133)), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        times.append(req.first_token_at - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="opt-1.3b")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = {"machine": machine(), "model": args.model}
    for graphs in (True, False):
        eng = Engine(EngineConfig(device="cuda", gpu_memory_budget=24 * 2**30, workspace_bytes=4 * 2**30,
                                  cuda_graphs=graphs))
        eng.register_model(args.model)
        eng.register_model(ModelSpec(args.model, alias="other", seed=1))
        res[f"cold_ttft_s_graphs_{'on' if graphs else 'off'}"] = cold_ttft(eng, args.model, args.repeats)
        if graphs:
            first = decode(eng, args.model, 64)
            again = decode(eng, args.model, 64)
            eng.offload(args.model)
            same = decode(eng, args.model, 64)  # reloaded into the same (now empty) place
            eng.offload(args.model)
            eng.load("other", wait=True)  # takes the first place: the model lands elsewhere
            moved = decode(eng, args.model, 64)
            for name, (n, s, lat) in (("first", first), ("warm", again), ("reload_same_address", same),
                                      ("reload_moved", moved)):
                res[name] = {"captures": n, "capture_s": s, "request_latency_s": lat}
        eng.executor.shutdown()
        del eng
    res["cold_ttft_graphs_on_over_off"] = res["cold_ttft_s_graphs_on"] / res["cold_ttft_s_graphs_off"]
    out = args.out or f"bench/results/graph_capture_{args.model}.json"
    write_json(out, res)
    for k in ("first", "warm", "reload_same_address", "reload_moved"):
        r = res[k]
        print(f"{k:22} captures {r['captures']}  capture {r['capture_s'] * 1e3:8.1f} ms  "
              f"64-token request {r['request_latency_s'] * 1e3:8.1f} ms")
    print(f"cold TTFT: graphs on {res['cold_ttft_s_graphs_on'] * 1e3:.1f} ms, off "
          f"{res['cold_ttft_s_graphs_off'] * 1e3:.1f} ms (ratio {res['cold_ttft_graphs_on_over_off']:.3f})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
