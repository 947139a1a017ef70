"""``computron bench calibrate MODEL...``: measure what ``computron sim`` needs on this device.

For each model (resident alone on the device, through the real engine):

- swap-in: offload, then load and wait for its copies (the engine's own path), median of
  ``--repeats``; eviction the same way. Bandwidth = image bytes / swap-in seconds;
- the legacy executor (``--executor legacy``) also: its first swap-in, from the pageable host memory
  the model was registered in (``pageable_swap_bandwidth``), and what an eviction costs more when the
  page-locked host memory it copies into must be allocated (``evict_pin_s_per_byte``): the first
  two evictions of a model allocate (the first's copy is still held while the second's is made);
  from the third on a freed copy is reused, and those are the steady evictions fitted;
- prefill: one request of P prompt tokens and one new token, for each P of ``--prompt``;
- decode: B requests decoding together, step time = (last token − first token) / (tokens − 1), for
  each B of ``--batch`` (as ``bench decode``);
- the weight-read floor (one pass over the model's bytes), which bounds every step from below;
- on a GPU, the host time of capturing a decode graph (the mean over the batch sizes' captures,
  warm-up left out): what the executor pays again when a model swapped back in lands at another address;
- on a machine of several GPUs, what the host side moves into all of them at once
  (``host_bandwidth``: the cap of a striped swap-in in the simulator);
- on a GPU, with the in-process executor, how much each extra model's decode step adds to a step of
  several models (``concurrent_step_fraction``, ``--shared-steps K``: K copies of the largest model
  stepped together against one a step through the engine, batch 1; ``bench/together.py``; with
  ``--serve`` too, through the engine all the same).

With ``--serve`` prefill and decode are timed through the HTTP server instead, as ``computron loadgen``
times them against ``computron serve``: the engine on its own thread behind the server, the requests
streamed by loadgen's client from another process. The server shares the engine's process, so its
work per request and per streamed token slows the engine's steps; a simulation that is to predict a
loadgen measurement wants a calibration that includes it.

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


class _Direct:
    """Prefill and decode timed on the engine itself (``Engine.run_until_done`` on this thread)."""

    def __init__(self, eng):
        self.eng = eng

    def call(self, fn, *args):
        return fn(*args)

    def prefill_s(self, model: str, ids: list[int]) -> float:
        from ..engine import SamplingParams

        t0 = time.perf_counter()
        req = self.eng.submit(model, ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        self.eng.run_until_done([req])
        return req.first_token_at - t0

    def decode_step_s(self, model: str, prompts: list[list[int]], new: int) -> float:
        from .decode import _engine_step_s

        return _engine_step_s(self.eng, model, len(prompts), prompts, new)

    def close(self) -> None:
        pass


class _Served:
    """Prefill and decode timed as ``computron loadgen`` times them against ``computron serve``: the
    engine on its own thread behind the HTTP server (on loopback), the requests streamed by loadgen's
    client from a process of its own (with loadgen's prompt ids, of the same lengths); a prefill is a
    lone request's time to its first token, a decode step (last end - last first token) / (tokens - 1)
    of B streams sent at once. The server's work per request and per streamed token, which shares the
    engine's process, is in these times."""

    def __init__(self, eng):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from ..config import ComputronConfig, ServerConfig
        from ..engine import AsyncEngine
        from ..server.app import create_app
        from ..server.background import ServerThread

        self.ae = AsyncEngine(eng)
        self.server = ServerThread(create_app(self.ae, ComputronConfig(server=ServerConfig(max_queue=4096)))).start()
        self.client = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    def call(self, fn, *args):
        return self.ae.call(fn, *args).result()

    def _replay(self, reqs: list[tuple[float, str, int, int]]) -> list[tuple[float, float, float]]:
        return self.client.submit(_replay, self.server.url, reqs).result()

    def prefill_s(self, model: str, ids: list[int]) -> float:
        ((sent, first, _),) = self._replay([(0.0, model, len(ids), 1)])
        return first - sent

    def decode_step_s(self, model: str, prompts: list[list[int]], new: int) -> float:
        recs = self._replay([(0.0, model, len(p), new) for p in prompts])
        return (max(end for _, _, end in recs) - max(first for _, first, _ in recs)) / (new - 1)

    def close(self) -> None:
        self.client.shutdown()
        self.server.stop()
        self.ae.shutdown()


_CLIENT: list = []  # in the client process: its event loop and HTTP client, kept across replays


def _replay(url: str, reqs: list[tuple[float, str, int, int]]) -> list[tuple[float, float, float]]:
    """In the client process: loadgen's replay of ``reqs`` (time, model, prompt tokens, new tokens)
    against ``url``; (sent, first token, end) of each, in seconds from the replay's start. One client
    serves every replay of the process, its connections kept alive between them as in one long
    loadgen run (a client made per replay put its connection's set-up into each lone request's time
    to first token)."""
    import asyncio

    import httpx

    from ..workload.loadgen import async_client, replay
    from ..workload.trace import Request

    if not _CLIENT:
        for _ in range(3000):  # the server answers 503 until its start-up is done
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                break
            time.sleep(0.01)
        loop = asyncio.new_event_loop()
        _CLIENT.extend([loop, async_client()])
    loop, client = _CLIENT
    recs = loop.run_until_complete(replay(url, [Request(*r) for r in reqs], client=client))
    bad = [r.error for r in recs if not r.ok]
    if bad:
        raise RuntimeError(f"a calibration request failed: {bad[0]}")
    return [(r.arrival, r.first_token, r.finish) for r in recs]


def torch_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def host_bandwidth(repeats: int, nbytes: int = 2**30) -> float:
    """Bytes/s the host side moves into every GPU of this machine at once (one pinned buffer, a slice
    per GPU, copied concurrently; the median of ``repeats``): what a striped swap-in can reach. 0 with
    fewer than two GPUs (nothing to cap)."""
    import torch

    from ..memory.host import host_buffer

    n = torch_gpus()
    if n < 2:
        return 0.0
    src = host_buffer(nbytes, pin=True)
    cut = [nbytes * i // n for i in range(n + 1)]
    dst = [torch.empty(cut[i + 1] - cut[i], dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]
    streams = [torch.cuda.Stream(f"cuda:{i}") for i in range(n)]
    times = []
    for _ in range(repeats + 1):  # the first warms the links up
        for i in range(n):
            torch.cuda.synchronize(i)
        t0 = time.perf_counter()
        for i, (d, st) in enumerate(zip(dst, streams)):
            with torch.cuda.stream(st):
                d.copy_(src[cut[i]:cut[i + 1]], non_blocking=True)
        for i in range(n):
            torch.cuda.synchronize(i)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:])


def run(models: list[str], device: str, batches: list[int], prompts: list[int], new: int, repeats: int,
        budget: str | None, executor: str | None = None, serve: bool = False, shared_steps: int = 0) -> dict:
    import torch

    from ..config import EngineConfig, ModelSpec
    from ..engine import Engine
    from ..sim.costs import Calibration, batch_time
    from .common import machine
    from .decode import weight_read_floor_s

    shared = None
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    # the path that steps models together; through the engine also for a served calibration (the
    # fraction is of the device's step, which the server does not change)
    if shared_steps >= 2 and cuda and executor != "legacy":
        try:
            shared = _shared_steps(models, device if device != "auto" else "cuda", shared_steps, repeats)
        except Exception as e:  # noqa: BLE001 -- the rest of the calibration stands without it
            import sys

            print(f"computron bench calibrate: the shared-step fraction was not measured ({type(e).__name__}: {e}); "
                  f"it stays 1 (one model's step after another)", file=sys.stderr)
    eng = Engine(EngineConfig(device=device, gpu_memory_budget=budget, executor=executor))
    dev = eng.executor.device if hasattr(eng.executor, "device") else torch.device("cpu")
    points = {"swap": [], "evict": [], "prefill": [], "decode": [], "floor": [], "capture": [], "warmup": []}
    legacy = executor == "legacy"
    if legacy:  # the first swap-in (pageable host memory) and the evictions that allocate page-locked memory
        points["first_swap"], points["pin_evict"] = [], []
    rng = np.random.default_rng(0)
    specs = [ModelSpec.parse(name) for name in models]
    for spec in specs:
        eng.register_model(spec)
        nbytes = eng.core.models[spec.name].total_bytes
        rounds = []
        for _ in range(repeats + 1 + legacy):  # the first round warms the path up (legacy: see the docstring)
            eng.core.offload(spec.name)
            t0 = time.perf_counter()
            eng.core.load(spec.name, wait=True)
            swap = time.perf_counter() - t0
            t0 = time.perf_counter()
            eng.core.offload(spec.name)
            rounds.append((swap, time.perf_counter() - t0))
        if legacy:
            points["first_swap"].append((spec.name, nbytes, rounds[0][0]))
            points["pin_evict"].append((spec.name, nbytes, rounds[1][1]))
        points["swap"] += [(spec.name, nbytes, s) for s, _ in rounds[1:]]
        points["evict"] += [(spec.name, nbytes, e) for _, e in rounds[1 + legacy:]]
        points["floor"].append((spec.name, nbytes, weight_read_floor_s(nbytes, dev)))
    path = _Served(eng) if serve else _Direct(eng)
    try:
        for spec in specs:
            nbytes = eng.core.models[spec.name].total_bytes
            vocab = eng.core.models[spec.name].config.vocab_size
            path.call(eng.core.load, spec.name, True)
            for p in prompts:
                times = [path.prefill_s(spec.name, rng.integers(0, vocab, p).tolist()) for _ in range(repeats + 1)]
                points["prefill"].append((spec.name, nbytes, p, statistics.median(times[1:])))
            plen = min(prompts)
            before = path.call(eng.executor.status).stats
            for b in batches:
                prompt_ids = [rng.integers(0, vocab, plen).tolist() for _ in range(b)]
                path.decode_step_s(spec.name, prompt_ids, new)  # warm-up (graph capture for this batch)
                step = statistics.median(path.decode_step_s(spec.name, prompt_ids, new) for _ in range(repeats))
                points["decode"].append((spec.name, nbytes, b, step))
            after = path.call(eng.executor.status).stats
            if after.get("graph_captures", 0) > before.get("graph_captures", 0):  # decode graphs (a GPU)
                n = after["graph_captures"] - before["graph_captures"]  # each bucket's first for this model
                again = (after["graph_recapture_s"] - before["graph_recapture_s"]) / n
                points["capture"].append((spec.name, nbytes, again))
                # what a first capture adds: the warm-up that compiles and tunes the bucket's kernels
                warm = (after["graph_capture_s"] - before["graph_capture_s"]) / n - again
                if warm > 0:
                    points["warmup"].append((spec.name, nbytes, warm))
            path.call(eng.core.offload, spec.name)
    finally:
        path.close()
    swap_bw = statistics.median(b / s for _, b, s in points["swap"])
    hbm = statistics.median(b / s for _, b, s in points["floor"])
    pf = _fit([(b, p, t) for _, b, p, t in points["prefill"]])
    dc = _fit([(b, n, t) for _, b, n, t in points["decode"]])
    ev = _fit([(b, 0, t) for _, b, t in points["evict"]])  # fixed + per byte (a copy back, if any)
    # a graph recorded again after a move: fixed + per byte (0 without graphs: the CPU, the legacy executor)
    gc = _fit([(b, 0, t) for _, b, t in points["capture"]]) if points["capture"] else (0.0, 0.0)
    gw = _fit([(b, 0, t) for _, b, t in points["warmup"]]) if points["warmup"] else (0.0, 0.0)
    pageable = pin = 0.0
    if legacy:
        pageable = statistics.median(b / s for _, b, s in points["first_swap"])
        steady = {m: statistics.median(t for n, _, t in points["evict"] if n == m) for m, _, _ in points["pin_evict"]}
        pin = max(0.0, statistics.median((t - steady[m]) / b for m, b, t in points["pin_evict"]))
    mem = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else \
        eng.executor.status().devices[0].budget
    cal = Calibration(name=f"measured:{machine().get('gpu', dev.type)}{' (served)' if serve else ''}",
                      swap_bandwidth=(swap_bw,), hbm_bandwidth=hbm,
                      prefill_fixed_s=pf[0], prefill_fixed_s_per_byte=pf[1], prefill_token_s=pf[2],
                      prefill_token_s_per_byte=pf[3], decode_fixed_s=dc[0], decode_fixed_s_per_byte=dc[1],
                      decode_seq_s=dc[2], decode_seq_s_per_byte=dc[3],
                      evict_s=ev[0], evict_s_per_byte=ev[1], device_memory=int(mem),
                      graph_capture_s=gc[0], graph_capture_s_per_byte=gc[1],
                      graph_warmup_s=gw[0], graph_warmup_s_per_byte=gw[1],
                      pageable_swap_bandwidth=pageable, evict_pin_s_per_byte=pin,
                      host_bandwidth=host_bandwidth(repeats) if dev.type == "cuda" else 0.0,
                      concurrent_step_fraction=shared["fraction"] if shared else 1.0)
    checks = []
    for kind in ("prefill", "decode"):
        for name, b, n, t in points[kind]:
            pred = batch_time(cal, b, n, 0) if kind == "prefill" else batch_time(cal, b, 0, n)
            checks.append({"kind": kind, "model": name, "n": n, "measured_s": t, "fit_s": pred,
                           "error": pred / t - 1})
    eng.executor.shutdown()
    return {"calibration": cal, "points": {k: v for k, v in points.items()}, "fit": checks, "shared_steps": shared,
            "path": "served" if serve else "engine", "machine": machine()}


def _shared_steps(models: list[str], device: str, k: int, repeats: int) -> dict:
    """``together.shared_step_fraction`` of the largest of ``models`` at batch 1, in a process of its
    own (its engines' device memory goes back before this one's engine takes the budget)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from ..config import ModelSpec
    from ..memory.layout import layout_for
    from ..models import resolve_model
    from .together import shared_step_fraction

    sources = [ModelSpec.parse(name).source for name in models]
    largest = max(sources, key=lambda m: layout_for(resolve_model(m)[0]).nbytes)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(shared_step_fraction, largest, device, k, 1, 64, repeats).result()


def main(args) -> int:
    from ..bench.common import print_table, write_json

    if not args.model:
        import torch

        gpu = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
        args.model = ["opt-125m", "opt-350m", "opt-1.3b"] if gpu else ["tiny-gpt2", "tiny-opt", "tiny-llama"]
    import sys

    try:
        res = run(args.model, args.device, args.batch, args.prompt, args.new_tokens, args.repeats,
                  args.gpu_memory_budget, args.executor, args.serve, getattr(args, "shared_steps", 0))
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
          + (f"first swap-in (pageable) {cal.pageable_swap_bandwidth / 1e9:.1f} GB/s, page-locked host memory "
             f"allocated {cal.evict_pin_s_per_byte * 1e9 * 1e3:.0f} ms/GB; " if args.executor == "legacy" else "")
          + (f"all {torch_gpus()} GPUs at once {cal.host_bandwidth / 1e9:.0f} GB/s; " if cal.host_bandwidth else "")
          + (f"{res['shared_steps']['models']} models a step {res['shared_steps']['speedup']:.2f}x one a step "
             f"(shared-step fraction {cal.concurrent_step_fraction:.2f}); " if res["shared_steps"] else "")
          + f"wrote {out} and {out.with_suffix('.points.json')}")
    return 0
