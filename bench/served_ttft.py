"""A lone request's time to first token: on the engine alone, and through the HTTP server with
loadgen's streamed client, once with a client made for each request (a new connection each time) and
once with one client kept across the requests (its connection reused, as a long loadgen run reuses
its connections). The difference of the two served figures is what a connection's set-up adds; the
kept one less the engine's is what the server adds to a first token. Medians of ``--repeats``
requests after one warm-up each, sent back to back.

    PYTHONPATH=src python bench/served_ttft.py [--model tiny-opt] [--device cpu] [--prompt 128] [--repeats 20]

Writes bench/results/served_ttft_<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def _fresh(url: str, model: str, prompt: int, n: int) -> list[float]:
    """In the client process: ``n`` lone requests, each replayed with a client of its own."""
    from computron.workload.loadgen import replay
    from computron.workload.trace import Request

    out = []
    for _ in range(n):
        (rec,) = asyncio.run(replay(url, [Request(0.0, model, prompt, 1)]))
        if not rec.ok:
            raise RuntimeError(rec.error)
        out.append(rec.first_token - rec.arrival)
    return out


def _kept(url: str, model: str, prompt: int, n: int) -> list[float]:
    """In the client process: ``n`` lone requests through one client kept across them."""
    from computron.bench.calibrate import _replay

    return [first - sent for ((sent, first, _),) in (_replay(url, [(0.0, model, prompt, 1)]) for _ in range(n))]


def main(argv=None) -> int:
    from computron.bench.common import machine, positive_int, write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-opt")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt", type=positive_int, default=128, help="prompt tokens")
    ap.add_argument("--repeats", type=positive_int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from computron.config import ComputronConfig, EngineConfig, ServerConfig
    from computron.engine import AsyncEngine, Engine, SamplingParams
    from computron.server.app import create_app
    from computron.server.background import ServerThread

    eng = Engine(EngineConfig(device=a.device))
    name = eng.register_model(a.model).name
    ids = list(range(1, a.prompt + 1))
    engine = []
    for _ in range(a.repeats + 1):
        t0 = time.perf_counter()
        req = eng.submit(name, ids, SamplingParams(max_tokens=1, ignore_eos=True))
        while not req.done:
            eng.step()
        engine.append(time.perf_counter() - t0)
    engine = engine[1:]
    ae = AsyncEngine(eng)
    srv = ServerThread(create_app(ae, ComputronConfig(server=ServerConfig(max_queue=4096)))).start()
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
            kept = ex.submit(_kept, srv.url, name, a.prompt, a.repeats + 1).result()[1:]
            fresh = ex.submit(_fresh, srv.url, name, a.prompt, a.repeats + 1).result()[1:]
    finally:
        srv.stop()
        ae.shutdown()
    med = {k: statistics.median(v) for k, v in (("engine", engine), ("served_kept", kept), ("served_fresh", fresh))}
    out = {"machine": machine(), "settings": vars(a), "median_s": med,
           "samples_s": {"engine": engine, "served_kept": kept, "served_fresh": fresh}}
    path = a.out or str(Path(__file__).parent / "results" / f"served_ttft_{a.device.split(':')[0]}.json")
    write_json(path, out)
    print(f"time to first token, {a.model}, {a.prompt}-token prompt, medians of {a.repeats}: engine alone "
          f"{med['engine'] * 1e3:.2f} ms; served, one client kept {med['served_kept'] * 1e3:.2f} ms; "
          f"served, a client per request {med['served_fresh'] * 1e3:.2f} ms -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
