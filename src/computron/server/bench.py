"""``computron bench serve``: what the HTTP server adds on top of the engine, under swaps.

One engine serves N copies of a model (``<name>-0`` … ``<name>-N-1``, each its own weights, so
a budget below N copies forces swaps). One workload (R requests, each to a random copy, random
prompt token ids, greedy, exactly ``--max-tokens`` new tokens, open-loop Poisson arrivals at
``--rate`` with at most ``--concurrency`` in flight) runs through the engine's own asyncio API
(``AsyncEngine.stream``) and through the real server on loopback (streamed completions over
httpx from a client process of its own, as a real client would be), alternating ``--repeat``
times. Time to first token, latency (p50/p99), throughput and swaps of both are printed as a
table, last, and written as JSON to ``--out``.

Times are taken on the client's clock from the moment it sends a request. The first token's
time is the engine's stamp (``Request.first_token_at``), not the first text received: tokens of
random-weight presets often decode to no text, so text can arrive late or only at the end. (The
client process shares the clock: ``time.perf_counter`` is CLOCK_MONOTONIC on Linux.) The engine
side's own latency (arrival to last token) is reported too, so that the overhead splits into
what the engine was slowed by and what the request path added.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from ..bench.common import machine, write_json

log = logging.getLogger("computron.server")


def add_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("serve", help="HTTP server overhead against the engine's direct API",
                                    description=__doc__.split("\n\n")[1])
    p.add_argument("--model", default="tiny-opt", help="preset or checkpoint directory (default tiny-opt)")
    p.add_argument("-n", "--copies", type=int, default=4, help="copies of the model to serve (default 4)")
    p.add_argument("-c", "--concurrency", type=int, default=1, help="requests in flight at most (default 1)")
    p.add_argument("--rate", type=float, default=math.inf, help="Poisson arrivals per second (default inf: "
                                                                "all at once, limited by --concurrency)")
    p.add_argument("-r", "--requests", type=int, default=64, help="requests per run (default 64)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (default 32)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per copy and path (default 2)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each path, alternating (default 1)")
    p.add_argument("--device", default="auto")
    p.add_argument("--gpu-memory-budget", default=None, help="e.g. 40GiB (default: 90%% of the device)")
    p.add_argument("--workspace", default=None)
    p.add_argument("--policy", default="default", choices=("default", "computron"))
    p.add_argument("--decode-steps", type=int, default=1, metavar="K", help="decode steps per engine call (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON output (default bench/results/serve_<model>.json)")
    p.set_defaults(func=bench_main)


@dataclass
class Item:
    model: str
    prompt: list[int]
    at: float  # seconds after the start of the run


@dataclass
class Sent:
    """What a client saw of one request (perf_counter times)."""

    rid: str
    sent: float
    end: float
    tokens: int


def workload(names: list[str], vocab: int, args) -> list[Item]:
    rng = random.Random(args.seed)
    t, items = 0.0, []
    for _ in range(args.requests):
        if math.isfinite(args.rate):
            t += rng.expovariate(args.rate)
        items.append(Item(rng.choice(names), [rng.randrange(3, vocab) for _ in range(args.prompt_len)], t))
    return items


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def _drive(items: list[Item], concurrency: int, one) -> tuple[list[Sent], float]:
    """Send each item at its arrival time (at most ``concurrency`` in flight); (results, wall seconds)."""
    import asyncio

    sem = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()

    async def run(item: Item) -> Sent:
        delay = item.at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        async with sem:
            return await one(item)

    sent = await asyncio.gather(*(run(i) for i in items))
    return list(sent), time.perf_counter() - t0


def _direct(ae, params):
    async def one(item: Item) -> Sent:
        t0 = time.perf_counter()
        req = None
        async for d in ae.stream(item.model, item.prompt, params):
            req = d.request
        return Sent(req.id, t0, time.perf_counter(), len(req.output_ids))

    return one


async def _http_one(client, url: str, item: Item, max_tokens: int) -> Sent:
    body = {"model": item.model, "prompt": item.prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    rid, tokens = "", 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if '"usage":{' in line:
                chunk = json.loads(line[6:])
                rid, tokens = chunk["id"], chunk["usage"]["completion_tokens"]
    return Sent(rid, t0, time.perf_counter(), tokens)


async def _http_run(url: str, items: list[Item], concurrency: int, max_tokens: int) -> tuple[list[Sent], float]:
    import asyncio

    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        while (await client.get(url + "/health")).status_code != 200:
            await asyncio.sleep(0.01)
        return await _drive(items, concurrency, lambda item: _http_one(client, url, item, max_tokens))


def http_client(url: str, items: list[Item], concurrency: int, max_tokens: int) -> tuple[list[Sent], float]:
    """The HTTP load generator; runs in a process of its own."""
    import asyncio

    return asyncio.run(_http_run(url, items, concurrency, max_tokens))


def summarize(runs: list[tuple[list[Sent], float]], reqs: dict, swaps: dict) -> dict:
    ttft, lat, eng_lat, admit, tokens, wall = [], [], [], [], 0, 0.0
    for sent, seconds in runs:
        wall += seconds
        for s in sent:
            r = reqs[s.rid]
            lat.append(s.end - s.sent)
            ttft.append(r.first_token_at - s.sent)
            eng_lat.append(r.finished_at - r.arrival)
            admit.append(r.arrival - s.sent)
            tokens += s.tokens
    ms = lambda xs, q: percentile(xs, q) * 1e3  # noqa: E731
    return {"requests": len(lat), "wall_s": wall, "output_tokens": tokens,
            "ttft_p50_ms": ms(ttft, 0.5), "ttft_p99_ms": ms(ttft, 0.99),
            "latency_p50_ms": ms(lat, 0.5), "latency_p99_ms": ms(lat, 0.99),
            "engine_latency_p50_ms": ms(eng_lat, 0.5), "admission_p50_ms": ms(admit, 0.5),
            "throughput_tok_s": tokens / wall if wall else 0.0, "throughput_req_s": len(lat) / wall if wall else 0.0,
            **swaps}


def run_bench(args) -> dict:
    """Both paths on one engine; returns the report."""
    import asyncio
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from ..config import ComputronConfig, EngineConfig, ModelSpec, ServerConfig
    from ..engine import AsyncEngine, Engine, SamplingParams
    from .app import create_app
    from .background import ServerThread

    engine = Engine(EngineConfig(device=args.device, gpu_memory_budget=args.gpu_memory_budget,
                                 workspace_bytes=args.workspace, policy=args.policy,
                                 decode_steps=args.decode_steps))
    base = Path(args.model).name
    names = [f"{base}-{i}" for i in range(args.copies)]
    for i, name in enumerate(names):
        log.info("registering %s (%d of %d)", name, i + 1, len(names))
        engine.register_model(ModelSpec(source=args.model, alias=name, seed=i), lambda m: log.info("  %s", m))
    entry = engine.models[names[0]]
    vocab = min(entry.cfg.vocab_size, getattr(entry.tokenizer, "vocab_size", entry.cfg.vocab_size))
    items = workload(names, vocab, args)
    warm = [Item(n, items[0].prompt if items else [5] * args.prompt_len, 0.0) for n in names] * args.warmup
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    # Benchmark instrumentation: keep every request the engine accepts (it drops finished ones),
    # for its first-token and finish stamps.
    reqs: dict = {}
    submit = engine.submit

    def keep(*a, **kw):
        req = submit(*a, **kw)
        reqs[req.id] = req
        return req

    engine.submit = keep
    ae = AsyncEngine(engine)
    stats = lambda: ae.call(lambda: dict(engine.stats)).result()  # noqa: E731
    runs: dict[str, list] = {"direct": [], "http": []}
    swaps = {p: {"swap_ins": 0, "evictions": 0, "swap_in_bytes": 0} for p in runs}

    def timed(path: str, fn) -> None:
        before = stats()
        runs[path].append(fn())
        after = stats()
        for k in swaps[path]:
            swaps[path][k] += after[k] - before[k]

    try:
        direct = _direct(ae, params)
        app = create_app(ae, ComputronConfig(server=ServerConfig(max_queue=max(256, args.requests))))
        spawn = multiprocessing.get_context("spawn")
        with ServerThread(app) as server, ProcessPoolExecutor(1, mp_context=spawn) as client:
            asyncio.run(_drive(warm, args.concurrency, direct))
            client.submit(http_client, server.url, warm, args.concurrency, args.max_tokens).result()
            for _ in range(args.repeat):
                timed("direct", lambda: asyncio.run(_drive(items, args.concurrency, direct)))
                timed("http", lambda: client.submit(http_client, server.url, items, args.concurrency,
                                                    args.max_tokens).result())
        info = {**machine(), "device": engine.memory()["devices"][0]["device"]}
    finally:
        ae.shutdown()
    results = {p: summarize(runs[p], reqs, swaps[p]) for p in runs}
    d, h = results["direct"], results["http"]
    overhead = {k: (h[k] / d[k] - 1.0) * 100 if d[k] else float("nan")
                for k in ("ttft_p50_ms", "latency_p50_ms", "latency_p99_ms", "engine_latency_p50_ms")}
    settings = {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf")
                for k, v in vars(args).items() if k not in ("func", "out", "command", "bench")}
    settings.update(budget=engine.memory()["budget"], model_bytes=entry.nbytes)
    return {"benchmark": "serve", "machine": info, "settings": settings, "results": results, "http_overhead_pct": overhead}


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s = report["settings"]
    table = Table(title=f"bench serve: {s['copies']} x {s['model']}, concurrency {s['concurrency']}, rate {s['rate']}"
                        f"/s, {s['requests']} requests x {s['repeat']}, {s['prompt_len']}+{s['max_tokens']} tokens")
    cols = [("TTFT p50 ms", "ttft_p50_ms"), ("TTFT p99 ms", "ttft_p99_ms"), ("lat p50 ms", "latency_p50_ms"),
            ("lat p99 ms", "latency_p99_ms"), ("engine lat p50", "engine_latency_p50_ms"), ("tok/s", "throughput_tok_s"),
            ("req/s", "throughput_req_s"), ("swap-ins", "swap_ins"), ("evictions", "evictions")]
    table.add_column("path")
    for title, _ in cols:
        table.add_column(title, justify="right")
    for path, r in report["results"].items():
        table.add_row(path, *(f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k]) for _, k in cols))
    o = report["http_overhead_pct"]
    table.add_row("http vs direct", f"{o['ttft_p50_ms']:+.1f}%", "", f"{o['latency_p50_ms']:+.1f}%",
                  f"{o['latency_p99_ms']:+.1f}%", f"{o['engine_latency_p50_ms']:+.1f}%", "", "", "", "")
    Console(width=max(Console().width, 140)).print(table)


def bench_main(args) -> int:
    from .cli import setup_logging

    setup_logging("info")
    if min(args.copies, args.concurrency, args.requests, args.prompt_len, args.max_tokens, args.repeat) < 1 \
            or args.rate <= 0:
        print("computron bench serve: copies, concurrency, requests, prompt-len, max-tokens, repeat and rate "
              "must be positive")
        return 2
    report = run_bench(args)
    out = write_json(args.out or f"bench/results/serve_{Path(args.model).name}.json", report)
    print_table(report)
    print(f"written to {out}")
    return 0
