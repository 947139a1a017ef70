"""Decode steps of several resident models at once, each on its own CUDA stream, against one after another.

Several models cannot share a batch (their weights differ), so with many models the engine runs
one model's decode step after another. A small-batch decode step of a 1.3B model is not bound by
reading its weights: on an H200 it takes about 3x the weight-read floor (``computron bench decode``),
its GEMMs running on a fraction of the SMs. If two models' steps overlap on the GPU, a round that
steps every resident model costs less than the sum of their steps, and a multi-model server
sustains a higher rate at the same SLO. This measures how much, before the engine is built for it.

For each K of ``--models``, K models of ``--model`` (random weights) are resident on GPU 0 under one
engine, and each model's decode graph for ``--batch`` rows (the engine's own ``DecodeGraph``, every
row reading ``--context`` cached tokens; nothing written) is replayed in rounds, each round timed by
the host between device synchronisations (an engine step ends with its sampled tokens read back):

- serial: the K graphs one after another on one stream (what the engine does now);
- concurrent: graph i on stream i, all K at once; the round ends when all have ended.

Each figure is the median round over ``--rounds`` after a warm-up, the two ways alternating
``--repeats`` times; the median of the repeats' medians is reported, with the weight-read floor of
the K models' weights (one pass over as many bytes) measured in the same run.

``--engine``: the same through the engine instead: K models each given ``--batch`` requests of
128 prompt tokens and ``--new-tokens`` greedy tokens at once, one engine stepping one model at a
time (``models_per_step`` 1) and one stepping all K together (``models_per_step`` K: the in-process
executor replays their graphs on separate streams), alternating; tokens per second of all K
models from the submission to the last token (prefills included), the median of ``--repeats``, and
the shared-step fraction that speed-up implies (``computron.bench.together``, as ``bench calibrate``
measures it for the simulator).

    PYTHONPATH=src python3 bench/concurrent_steps.py [--model opt-1.3b] [--models 1 2 3 4]
        [--batch 1 8 32] [--context 256] [--out bench/results/concurrent_steps_<gpu>.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from computron.bench import together
from computron.bench.common import machine, positive_int, print_table, write_json
from computron.bench.decode import weight_read_floor_s
from computron.config import EngineConfig, ModelSpec
from computron.engine import Engine
from computron.memory.layout import layout_for
from computron.models import resolve_model


def _round_s(graphs, streams, rounds: int, warmup: int = 3) -> float:
    """Median seconds of a round: every graph replayed once, on ``streams[i]`` (one stream: in turn)."""
    dev = torch.device("cuda", 0)
    main = torch.cuda.current_stream(dev)
    times = []
    for i in range(warmup + rounds):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for g, s in zip(graphs, streams):
            if s is main:
                g.graph.replay()
            else:
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    g.graph.replay()
        torch.cuda.synchronize(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main_engine(args, cfg, nbytes: int) -> int:
    res = {"machine": machine(), "settings": vars(args), "weight_bytes": nbytes, "engine_rows": []}
    rows = []
    for k in args.models:
        if k < 2:
            continue
        engs = together.engines(args.model, k, max(args.batch), args.new_tokens, "cuda")
        for b in args.batch:
            row = together.measure(engs, k, b, args.new_tokens, args.repeats, cfg.vocab_size)
            res["engine_rows"].append(row)
            one, x = statistics.median(row["tokens_per_s_one_a_step"]), row["speedup"]
            rows.append([k, b, one, one * x, x, row["fraction"]])
            print(f"engine K={k} batch={b}: {one:.0f} tokens/s one model a step, {one * x:.0f} together "
                  f"({x:.2f}x, shared-step fraction {row['fraction']:.2f})", flush=True)
        for eng in engs.values():
            eng.executor.shutdown()
    gpu = torch.cuda.get_device_name(0).lower().replace("nvidia ", "").split()[0]
    out = args.out or f"bench/results/concurrent_steps_engine_{gpu}.json"
    write_json(out, res)
    print_table(f"decode tokens/s of K {args.model} models through the engine, batch B each",
                ["K", "B", "one model a step", "K together", "x", "fraction"], rows)
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="opt-1.3b")
    ap.add_argument("--models", type=positive_int, nargs="+", default=[1, 2, 3, 4], help="K: models stepped a round")
    ap.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8, 32], help="rows of each model's step")
    ap.add_argument("--context", type=positive_int, default=256, help="cached tokens each row reads")
    ap.add_argument("--rounds", type=positive_int, default=50)
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--engine", action="store_true", help="through the engine: one model a step against K")
    ap.add_argument("--new-tokens", type=positive_int, default=64, help="--engine: tokens each request makes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg, _ = resolve_model(args.model)
    nbytes, top, kmax = layout_for(cfg).nbytes, max(args.batch), max(args.models)
    if args.engine:
        return main_engine(args, cfg, nbytes)
    workspace = 4 * 2**30
    eng = Engine(EngineConfig(device="cuda", gpu_memory_budget=workspace + kmax * nbytes + 2**30,
                              workspace_bytes=workspace, max_batch_size=top))
    names = [f"m{i}" for i in range(kmax)]
    for i, n in enumerate(names):
        eng.register_model(ModelSpec(args.model, alias=n, seed=i))
        eng.load(n, wait=True)
    ex = eng.executor
    width_blocks = -(-args.context // ex.block_tokens)
    dev = torch.device("cuda", 0)
    streams = [torch.cuda.Stream(dev) for _ in range(kmax)]
    floor = {k: weight_read_floor_s(k * nbytes, dev) for k in args.models}
    res = {"machine": machine(), "settings": vars(args), "weight_bytes": nbytes, "floor_s": floor, "rows": []}
    rows = []
    for b in args.batch:
        graphs = []
        for n in names:
            ex._bind(n)  # the runner points at the resident weights, as a step does before it runs
            m, region = ex.models[n], ex.resident[n].region
            g = m.graphs.get(m.runner, m.pool, b, region.tensor.data_ptr())
            # every row reads ``context`` cached tokens from blocks 0..; slot -1 writes no key or value
            g.run([0] * b, [args.context] * b, [-1] * b, [args.context] * b, [list(range(width_blocks))] * b)
            graphs.append(g)
        torch.cuda.synchronize(dev)
        for k in args.models:
            serial, concurrent = [], []
            for _ in range(args.repeats):  # alternating: a drift of the machine hits both alike
                serial.append(_round_s(graphs[:k], [torch.cuda.current_stream(dev)] * k, args.rounds))
                concurrent.append(_round_s(graphs[:k], streams[:k], args.rounds))
            s, c = statistics.median(serial), statistics.median(concurrent)
            row = {"models": k, "batch": b, "serial_round_s": serial, "concurrent_round_s": concurrent,
                   "serial_s": s, "concurrent_s": c, "speedup": s / c, "floor_s": floor[k]}
            res["rows"].append(row)
            rows.append([k, b, s * 1e3, s / k * 1e3, c * 1e3, c / k * 1e3, s / c, floor[k] * 1e3])
            print(f"K={k} batch={b}: serial {s * 1e3:.3f} ms, concurrent {c * 1e3:.3f} ms ({s / c:.2f}x), "
                  f"floor {floor[k] * 1e3:.3f} ms", flush=True)
    ex.shutdown()
    gpu = torch.cuda.get_device_name(0).lower().replace("nvidia ", "").split()[0]
    out = args.out or f"bench/results/concurrent_steps_{gpu}.json"
    write_json(out, res)
    print_table(f"a round of decode steps of K {args.model} models, batch B each, {args.context} cached tokens a row",
                ["K", "B", "serial ms", "a step", "concurrent ms", "a step", "x serial", "weight floor ms"], rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
