"""Paged attention paths on one GPU: decode time per layer call against the time to read its K/V
bytes at the copy bandwidth measured in the same run, prefill time, and the cache write.

    PYTHONPATH=src python bench/attention_kernels.py [--out bench/results/attention_kernels_h200.json]
    PYTHONPATH=src python bench/attention_kernels.py --small      # CPU smoke run, tiny sizes

Paths: ``torch`` (gather + float32 matmul/softmax, the portable reference), ``sdpa`` (gather +
``scaled_dot_product_attention`` with a mask, input dtype), ``flex`` (gather + compiled
FlexAttention with a length block mask built per call), ``triton`` (kernels reading the blocks in
place; decode split over the keys as the dispatcher does) and ``triton_nosplit``.

Two times per path: ``us``, CUDA events around one call issued to an idle GPU (what an eager step
pays, host launch work included), and ``graph_us``, device time per call from replaying a CUDA graph
of calls over all rotations (what a graph-captured step pays; paths that sync or build masks on the
host are left out). The KV pool holds two layers per block (the layer views are strided, as in
serving) and calls rotate over disjoint block sets of at least 256 MB together, so the keys come
from HBM, not the L2 cache.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import signal
import statistics
import sys
import time

import torch

from computron.models import attention as A

MODELS = {"opt-1.3b": (32, 32, 64), "llama-3-8b": (32, 8, 128)}  # query heads, kv heads, head dim


def timer(device, warmup, iters):
    """Median and p90 of per-call times (µs) of fn(i), with CUDA events on a GPU."""

    def run(fn):
        for i in range(warmup):
            fn(i)
        times = []
        for i in range(iters):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn(i)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            else:
                t0 = time.perf_counter()
                fn(i)
                times.append((time.perf_counter() - t0) * 1e6)
        times.sort()
        return statistics.median(times), times[int(0.9 * (len(times) - 1))]

    return run


def graph_timer(reps):
    """Device time per call (µs): calls over every rotation captured in one CUDA graph, median of replays."""

    def run(fn, rot):
        n = max(rot, 8)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(3):
                fn(i % rot)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(n):
                fn(i % rot)
        g.replay()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / n)
        return statistics.median(times)

    return run


def copy_bandwidth(device, nbytes, run):
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    med, _ = run(lambda i: dst.copy_(src))
    return 2 * nbytes / (med * 1e-6)  # bytes read + written per second


def flex_paths(device):
    """FlexAttention over gathered K/V (compiled on CUDA); None where it does not import."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    if device.type == "cuda":
        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
        flex_attention = torch.compile(flex_attention, dynamic=False)

    def decode(lens):  # one mask function per case: compiled code is reused across its calls
        def mask(b, h, i, j):
            return j < lens[b]

        def run(q, kc, vc, table, scale):
            L = table.shape[1] * kc.shape[1]
            k, v = (A.gather_kv(c, table, lens, L).transpose(1, 2) for c in (kc, vc))
            bm = create_block_mask(mask, q.shape[0], None, 1, L, device=q.device)
            return flex_attention(q[:, :, None], k, v, block_mask=bm, scale=scale, enable_gqa=True)[:, :, 0]

        return run

    def prefill(lens, qlens, cu, max_q):
        past, cu = lens - qlens, cu.long()

        def mask(b, h, i, j):
            return (j <= past[b] + i) & (j < lens[b])

        def run(q, kc, vc, table, scale):
            B, L = lens.numel(), table.shape[1] * kc.shape[1]
            k, v = (A.gather_kv(c, table, lens, L).transpose(1, 2) for c in (kc, vc))
            seq = torch.repeat_interleave(torch.arange(B, device=q.device), qlens, output_size=q.shape[0])
            row = torch.arange(q.shape[0], device=q.device) - cu[seq]
            qp = q.new_zeros(B, max_q, *q.shape[1:])
            qp[seq, row] = q
            bm = create_block_mask(mask, B, None, max_q, L, device=q.device)
            o = flex_attention(qp.transpose(1, 2), k, v, block_mask=bm, scale=scale, enable_gqa=True)
            return o.transpose(1, 2)[seq, row]

        return run

    return decode, prefill


def kv_case(hq, hk, d, seqs, ctx, bs, dtype, device, min_bytes, layers=2):
    """Rotations of (q, k view, v view, block table) over disjoint blocks of one pool."""
    per_seq = -(-ctx // bs)
    kv_bytes = seqs * ctx * hk * d * 2 * torch.finfo(dtype).bits // 8
    rot = max(2, min(64, -(-min_bytes // kv_bytes)))
    pool = torch.randn(rot * seqs * per_seq, layers, 2, bs, hk, d, dtype=dtype, device=device)
    tables = torch.randperm(pool.shape[0], device=device).to(torch.int32).view(rot, seqs, per_seq)
    return pool, pool[:, 0, 0], pool[:, 0, 1], tables, rot, kv_bytes


def rel_err(x, ref):
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def measure(paths, qs, tables, rot, ref, clock, row, eager=True):
    """paths: name -> (fn, graph-capturable). Eager and graph times and the error against ref into row."""
    row.update(us={}, p90_us={}, graph_us={}, rel_err={})
    for name, (fn, capturable) in paths.items():
        try:
            row["rel_err"][name] = rel_err(fn(qs[0], tables[0]), ref)
            if eager:
                row["us"][name], row["p90_us"][name] = clock.eager(lambda i: fn(qs[i % rot], tables[i % rot]))
            if capturable and clock.graph:
                row["graph_us"][name] = clock.graph(lambda i: fn(qs[i], tables[i]), rot)
        except Exception as e:  # a candidate that fails is reported, not fatal
            row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
            if clock.graph:
                torch.cuda.synchronize()
    return row


def decode_case(model, B, ctx, bs, dtype, device, min_bytes, bw, clock, has_triton, flex=None, sweep=False):
    hq, hk, d = MODELS[model]
    scale = d**-0.5
    _, kc, vc, tables, rot, kv_bytes = kv_case(hq, hk, d, B, ctx, bs, dtype, device, min_bytes)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    qs = torch.randn(rot, B, hq, d, dtype=dtype, device=device)
    paths = {}
    if not sweep:
        for impl in ("torch", "sdpa"):  # no-sync variants (max_len given) for graph capture
            paths[impl] = (lambda q, t, impl=impl: A._decode_torch(q, kc, vc, t, lens, scale, impl == "sdpa", ctx), True)
        if flex:
            f = flex[0](lens)
            paths["flex"] = (lambda q, t: f(q, kc, vc, t, scale), False)
    if has_triton:
        paths["triton"] = (lambda q, t: A.decode_attention(q, kc, vc, t, lens, impl="triton"), True)
        paths["triton_nosplit"] = (lambda q, t: A._decode_triton(q, kc, vc, t, lens, scale, num_splits=1), True)
    if has_triton and sweep:
        for bn, w in [(32, 2), (32, 4), (64, 8), (128, 4), (128, 8)]:
            paths[f"bn{bn}_w{w}"] = (lambda q, t, bn=bn, w=w: A._decode_triton(q, kc, vc, t, lens, scale, block_n=bn, num_warps=w), True)
        for sp in (2, 4, 8, 16, 32):
            paths[f"splits{sp}"] = (lambda q, t, sp=sp: A._decode_triton(q, kc, vc, t, lens, scale, num_splits=sp), True)
    ref = A.decode_attention(qs[0], kc, vc, tables[0], lens, impl="torch")
    row = dict(model=model, batch=B, context=ctx, kv_bytes=kv_bytes, rotations=rot, floor_us=kv_bytes / bw * 1e6)
    if has_triton:
        row["auto_splits"] = A._splits(B * hk, tables.shape[-1] * bs, device)
    return measure(paths, qs, tables, rot, ref, clock, row, eager=not sweep)


def prefill_case(model, seqs, n, past, bs, dtype, device, min_bytes, clock, has_triton, flex=None, sweep=False):
    hq, hk, d = MODELS[model]
    scale, ctx = d**-0.5, past + n
    _, kc, vc, tables, rot, _ = kv_case(hq, hk, d, seqs, ctx, bs, dtype, device, min_bytes)
    lens = torch.full((seqs,), ctx, dtype=torch.int32, device=device)
    qlens = torch.full((seqs,), n, dtype=torch.int32, device=device)
    cu = torch.arange(seqs + 1, dtype=torch.int32, device=device) * n
    qs = torch.randn(rot, seqs * n, hq, d, dtype=dtype, device=device)
    paths = {}
    if not sweep:
        for impl in ("torch", "sdpa"):
            paths[impl] = (lambda q, t, impl=impl: A._prefill_torch(q, kc, vc, t, lens, qlens, cu, scale, impl == "sdpa", n, ctx), True)
        if flex:
            f = flex[1](lens, qlens, cu, n)
            paths["flex"] = (lambda q, t: f(q, kc, vc, t, scale), False)
    if has_triton:
        paths["triton"] = (lambda q, t: A.prefill_attention(q, kc, vc, t, lens, qlens, cu, impl="triton"), True)
    if has_triton and sweep:
        for bm, bn, w in [(64, 32, 4), (64, 64, 8), (128, 32, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8)]:
            paths[f"bm{bm}_bn{bn}_w{w}"] = (lambda q, t, bm=bm, bn=bn, w=w: A._prefill_triton(
                q, kc, vc, t, lens, cu, scale, block_m=bm, block_n=bn, num_warps=w), True)
    ref = A.prefill_attention(qs[0], kc, vc, tables[0], lens, qlens, cu, impl="torch")
    flops = 4 * hq * d * seqs * sum(past + i + 1 for i in range(n))
    row = dict(model=model, seqs=seqs, new_tokens=n, past=past, flops=flops)
    return measure(paths, qs, tables, rot, ref, clock, row, eager=not sweep)


def write_case(model, seqs, n, past, bs, dtype, device, bw, clock, has_triton):
    """write_kv of seqs × n new tokens into the strided layer views, at the slots their block tables give."""
    hq, hk, d = MODELS[model]
    pool, kc, vc, tables, rot, _ = kv_case(hq, hk, d, seqs, past + n, bs, dtype, device, 64 << 20)
    slots = (tables.long()[..., None] * bs + torch.arange(bs, device=device)).flatten(2)[:, :, past : past + n].flatten(1)
    kv = torch.randn(rot, seqs * n, 2, hk, d, dtype=dtype, device=device)
    row = dict(model=model, tokens=seqs * n, floor_us=4 * kv[0, :, 0].numel() * kv.element_size() / bw * 1e6,
               us={}, graph_us={}, correct={})
    for impl in ["torch"] + ["triton"] * has_triton:
        fn = lambda i, impl=impl: A.write_kv(kc, vc, kv[i % rot, :, 0], kv[i % rot, :, 1], slots[i % rot], impl=impl)  # noqa: E731
        pool.zero_()
        fn(0)
        at = (slots[0] // bs, slots[0] % bs)
        row["correct"][impl] = torch.equal(kc[at], kv[0, :, 0]) and torch.equal(vc[at], kv[0, :, 1]) and not pool[:, 1].any().item()
        row["us"][impl], _ = clock.eager(fn)
        try:
            if clock.graph:
                row["graph_us"][impl] = clock.graph(fn, rot)
        except Exception as e:  # e.g. a path that syncs cannot be captured
            row.setdefault("errors", {})[impl] = f"{type(e).__name__}: {str(e)[:300]}"
            torch.cuda.synchronize()
    return row


class Clock:
    def __init__(self, device, warmup, iters):
        self.eager = timer(device, warmup, iters)
        self.graph = graph_timer(iters) if device.type == "cuda" else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes and few repeats (a CPU smoke run)")
    ap.add_argument("--out", default="bench/results/attention_kernels.json")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time Triton tile sizes, warps and key splits")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--batches", nargs="*", type=int)
    ap.add_argument("--contexts", nargs="*", type=int)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    bs = 16
    if args.small:
        batches, contexts, pre = [1, 4], [32, 64], (2, 16)
        warmup, iters, min_bytes, copy_bytes = 1, 5, 1 << 20, 16 << 20
    else:
        batches, contexts, pre = [1, 8, 32, 128], [256, 1024], (8, 128)
        warmup, iters, min_bytes, copy_bytes = 5, 30, 256 << 20, 2 << 30
    batches, contexts = args.batches or batches, args.contexts or contexts
    clock = Clock(device, warmup, iters)
    has_triton = A.triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    flex = None if args.no_flex else flex_paths(device)
    flex_shapes = {(8, 1024), (128, 1024), (4, 64)}  # each shape compiles anew: a subset
    t_start = time.time()
    bw = copy_bandwidth(device, copy_bytes, clock.eager)
    decode_rows, prefill_rows, write_rows, sweep_rows = [], [], [], []
    result = dict(
        benchmark="attention_kernels",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=dict(host=platform.node(), device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
                     gpus=torch.cuda.device_count(), torch=torch.__version__, cuda=torch.version.cuda,
                     triton=getattr(A.triton, "__version__", None)),
        settings=dict(dtype=str(dtype), block_size=bs, warmup=warmup, iters=iters, kv_pool_layers=2, min_rotation_bytes=min_bytes,
                      copy_bytes=copy_bytes, small=args.small,
                      timing="CUDA events around each call, median" if device.type == "cuda" else "perf_counter per call, median"),
        copy_bandwidth_GBps=bw / 1e9, complete=False,
        decode=decode_rows, prefill=prefill_rows, write_kv=write_rows, sweep=sweep_rows,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout still leaves the JSON of what ran
    try:
        for model in args.models:
            hq, hk, d = MODELS[model]
            for ctx in contexts:
                for B in batches:
                    use_flex = flex if (B, ctx) in flex_shapes and time.time() - t_start < 120 else None
                    decode_rows.append(decode_case(model, B, ctx, bs, dtype, device, min_bytes, bw, clock, has_triton, use_flex))
            seqs, n = pre  # prefill: `seqs` sequences of n new tokens, fresh and after a cached past
            for past in (0, max(contexts) - n):
                use_flex = flex if past == 0 and time.time() - t_start < 170 else None
                prefill_rows.append(prefill_case(model, seqs, n, past, bs, dtype, device, min_bytes // 4, clock, has_triton, use_flex))
                write_rows.append(write_case(model, seqs, n, past, bs, dtype, device, bw, clock, has_triton))
        if args.sweep and has_triton:
            for model in args.models:
                for B, ctx in [(1, 1024), (8, 1024), (32, 256), (128, 1024)] if not args.small else [(1, 64)]:
                    sweep_rows.append(decode_case(model, B, ctx, bs, dtype, device, min_bytes, bw, clock, has_triton, sweep=True))
                for past in (0, max(contexts) - pre[1]):
                    sweep_rows.append(prefill_case(model, *pre, past, bs, dtype, device, min_bytes // 4, clock, has_triton, sweep=True))
        result["complete"] = True
    finally:
        result["seconds"] = time.time() - t_start
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        report(result)


def report(result):
    fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    eager, graph = ["torch", "sdpa", "flex", "triton"], ["torch", "sdpa", "triton", "triton_nosplit"]
    m = result["machine"]
    print(f"\n{m['device']}, torch {m['torch']}, triton {m['triton']}; copy {result['copy_bandwidth_GBps']:.0f} GB/s (read+write)")
    print("times in µs per call, median; eager: events around one call from an idle GPU; graph: CUDA-graph replay")
    head = "".join(f"{n:>9}" for n in eager) + " |" + "".join(f"{n.replace('triton_', ''):>10}" for n in graph)
    print(f"{'decode':<11}{'B':>4}{'ctx':>6}{'KV MB':>7}{'floor':>7} |{head}{'triton/floor':>13}")
    for r in result["decode"]:
        tg = r["graph_us"].get("triton")
        print(f"{r['model']:<11}{r['batch']:>4}{r['context']:>6}{r['kv_bytes'] / 1e6:>7.1f}{r['floor_us']:>7.1f} |"
              + "".join(f"{fmt(r['us'].get(n)):>9}" for n in eager) + " |" + "".join(f"{fmt(r['graph_us'].get(n)):>10}" for n in graph)
              + f"{(tg or math.nan) / r['floor_us']:>13.2f}")
    head = "".join(f"{n:>9}" for n in eager) + " |" + "".join(f"{n:>10}" for n in graph[:3])
    print(f"{'prefill':<11}{'seqs':>5}{'new':>5}{'past':>6} |{head}{'triton TFLOP/s':>16}")
    for r in result["prefill"]:
        tg = r["graph_us"].get("triton")
        print(f"{r['model']:<11}{r['seqs']:>5}{r['new_tokens']:>5}{r['past']:>6} |"
              + "".join(f"{fmt(r['us'].get(n)):>9}" for n in eager) + " |" + "".join(f"{fmt(r['graph_us'].get(n)):>10}" for n in graph[:3])
              + f"{r['flops'] / (tg or math.nan) / 1e6:>16.1f}")
    for r in result["write_kv"]:
        print(f"write_kv {r['model']:<11}{r['tokens']:>5} tokens: floor {r['floor_us']:.1f}; eager "
              + ", ".join(f"{k} {fmt(v)}" for k, v in r["us"].items()) + "; graph "
              + ", ".join(f"{k} {fmt(v)}" for k, v in r["graph_us"].items()) + f"; correct {r['correct']}")
    for r in result["sweep"]:
        shape = f"B{r['batch']} ctx{r['context']}" if "batch" in r else f"prefill past{r['past']}"
        print(f"sweep(graph) {r['model']:<11}{shape:<16}" + " ".join(f"{k}={fmt(v)}" for k, v in r["graph_us"].items()))
    rows = result["decode"] + result["prefill"] + result["sweep"]
    for r in rows:
        for k, v in r.get("errors", {}).items():
            print("error:", r["model"], k, v)
    print(f"max rel err vs torch: {max((v for r in rows for v in r['rel_err'].values()), default=0):.2e}; complete: {result['complete']}")


if __name__ == "__main__":
    main()
