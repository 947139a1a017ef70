"""Striped swap-in of a model that lives on one GPU, through the host links of k GPUs at once.

For each k of ``--gpus`` (the model on GPU 0, GPUs 1 .. k-1 lending their links and two staging
slots each), in one run, each the median of ``--repeats`` after a warm-up, all timed by the host
around a synchronize of every GPU involved:
- one link: a raw pinned memcpy of the whole image into GPU 0 (one copy);
- k links at once: GPU i copies the i-th k-th of the image into its own memory, all concurrently
  (what the host side and the links allow together: the ceiling of any striping);
- the engine's plain swap-in (``ImageSwapper``: a copy per layer group, over GPU 0's link);
- the striped swap-in (``StripedSwapper``), for each ``--chunk``, and when its first layer group
  was in (what a cold request's first layer waits for).
The striped copy is checked byte for byte against the one-link copy, and every helper's staging
is checked to be returned after the swap. Writes bench/results/striped_swap_<gpu>.json.

``--executor workers``: the same model through the worker executor instead (one process per GPU,
``memory/relay.py``): for each k and chunk, a load over GPU 0's link alone and one striped through
GPUs 1 .. k-1 (helpers relaying chunks of the shared host image over NCCL sends), each timed by the
host around the load and by the model's worker's copy events (first to last byte), the striped image
checked against the host image by digest. Writes bench/results/striped_swap_workers_<gpu>.json.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 bench/striped_swap.py --model opt-13b --gpus 2 4
    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 bench/striped_swap.py --model opt-1.3b --gpus 2 --executor workers
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from computron.bench.common import machine, positive_int, print_table, write_json
from computron.memory.arena import Arena
from computron.memory.host import HostImage
from computron.memory.layout import layout_for
from computron.memory.striped import StripedSwapper
from computron.memory.swapper import ImageSwapper
from computron.models import resolve_model


def _timed(fn, devices, repeats: int) -> list[float]:
    out = []
    for i in range(repeats + 1):
        for d in devices:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        fn()
        for d in devices:
            torch.cuda.synchronize(d)
        if i:  # the first is the warm-up
            out.append(time.perf_counter() - t0)
    return out


def measure(image: HostImage, k: int, chunks: list[int], repeats: int) -> dict:
    devs = [torch.device("cuda", i) for i in range(k)]
    n = image.nbytes
    src = image.buffer
    one = torch.empty(n, dtype=torch.uint8, device=devs[0])
    raw_one = _timed(lambda: one.copy_(src, non_blocking=True), devs[:1], repeats)

    bounds = [n * i // k for i in range(k + 1)]
    parts = [torch.empty(bounds[i + 1] - bounds[i], dtype=torch.uint8, device=d) for i, d in enumerate(devs)]
    streams = [torch.cuda.Stream(d) for d in devs]

    def concurrent():
        for i, (p, s) in enumerate(zip(parts, streams)):
            with torch.cuda.stream(s):
                p.copy_(src[bounds[i]:bounds[i + 1]], non_blocking=True)

    raw_k = _timed(concurrent, devs, repeats)
    del parts
    arena = Arena(n + 2**20, devs[0])
    out = {"gpus": k, "bytes": n, "raw_one_link_s": raw_one, "raw_k_links_s": raw_k}

    def swaps(sw) -> tuple[list[float], list[float], bool]:
        """Timed swap-ins (and when each one's first group was in), then one more checked against
        the one-link copy, outside the timing."""
        firsts, links = [], []

        def once():
            region, swap = sw.swap_in("m", image)
            swap.events[-1].synchronize()
            firsts.append(swap.start.elapsed_time(swap.events[0]) / 1e3)
            if swap.link_ends:
                links.append([swap.start.elapsed_time(e) / 1e3 for e in swap.link_ends])
            sw.swap_out(region)

        t = _timed(once, devs, repeats)
        region, swap = sw.swap_in("m", image)
        swap.events[-1].synchronize()
        equal = bool(torch.equal(region.tensor, one))
        sw.swap_out(region)
        out["link_ends_s"] = links[1:]  # the last swaps' (read by the caller right after)
        return t, firsts[1:], equal

    out["plain_swap_s"], out["plain_first_group_s"], out["plain_bytes_equal"] = swaps(ImageSwapper(arena))
    out.pop("link_ends_s")
    out["striped"] = {}
    if k > 1:
        for c in chunks:
            sw = StripedSwapper(arena, devs[1:], chunk=c * 2**20)
            t, first, ok = swaps(sw)
            time.sleep(0.2)  # the threads that return the staging wait for the last push
            out["striped"][c] = {"swap_s": t, "first_group_s": first, "bytes_equal": ok,
                                 "staging_per_helper": sw.helpers[0].nbytes,
                                 "staging_held_after": sum(sw.borrowed().values()),
                                 # per repeat, when each link's last bytes landed (own link first): a
                                 # straggler shows as one link ending after the others
                                 "link_ends_s": out.pop("link_ends_s")}
            del sw
    del arena, one
    torch.cuda.empty_cache()
    return out


def measure_workers(model: str, k: int, chunk: int, repeats: int) -> dict:
    """Loads of ``model`` onto GPU 0 under the worker executor: plain, then striped through GPUs 1 .. k-1."""
    from computron.config import EngineConfig
    from computron.engine.workers import WorkerExecutor
    from computron.messages import ModelDescription, Placement, Residency

    ex = WorkerExecutor(EngineConfig(device="cuda", executor="workers", devices=k, cuda_graphs=False,
                                     stripe_devices=list(range(1, k)), stripe_chunk_bytes=chunk * 2**20))
    try:
        t0 = time.perf_counter()
        ex.register(ModelDescription("m", model, placement=Placement(devices=(0,))))
        out = {"gpus": k, "chunk_mib": chunk, "register_s": time.perf_counter() - t0}
        for how, stripes in (("plain", {}), ("striped", {"m": tuple(range(1, k))})):
            walls, copies = [], []
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                ex.apply(Residency(load=["m"], stripes=stripes))
                copy_s = ex.wait_loads()["m"]
                if i:  # the first is the warm-up
                    walls.append(time.perf_counter() - t0)
                    copies.append(copy_s)
                if how == "striped" and i == repeats:
                    out["bytes_equal"] = ex.weights_digest("m") == ex.image_digest("m")
                ex.apply(Residency(evict=["m"]))
            out[how] = {"wall_s": walls, "copy_s": copies}
        out["staging_held_after"] = ex.status().stats.get("stripe_staging_bytes", 0)
        return out
    finally:
        ex.shutdown()


def main_workers(args) -> int:
    med = statistics.median
    res = {"machine": machine(), "settings": vars(args), "model": args.model, "runs": []}
    rows = []
    for k in [g for g in args.gpus if g > 1]:
        for c in args.chunk:
            r = measure_workers(args.model, k, c, args.repeats)
            print(f"{k} GPUs, {c} MiB chunks: workers started and {args.model} registered in {r['register_s']:.1f} s",
                  flush=True)
            res["runs"].append(r)
            plain, striped = med(r["plain"]["copy_s"]), med(r["striped"]["copy_s"])
            rows.append([k, c, plain * 1e3, striped * 1e3, plain / striped, med(r["plain"]["wall_s"]) * 1e3,
                         med(r["striped"]["wall_s"]) * 1e3, r["bytes_equal"] and r["staging_held_after"] == 0])
    gpu = torch.cuda.get_device_name(0).lower().replace("nvidia ", "").split()[0]
    out = args.out or f"bench/results/striped_swap_workers_{gpu}.json"
    write_json(out, res)
    print_table(f"striped swap-in of {args.model} onto GPU 0 under workers, medians (ms)",
                ["GPUs", "chunk MiB", "plain copy ms", "striped copy ms", "x plain", "plain wall ms",
                 "striped wall ms", "bytes equal, staging back"], rows)
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="opt-13b")
    ap.add_argument("--gpus", type=positive_int, nargs="+", default=[2, 4])
    ap.add_argument("--chunk", type=positive_int, nargs="+", default=None,
                    help="MiB a link moves at a time (default: 16 32 64; with --executor workers 32, the engine's "
                         "default, since each chunk size starts the workers and registers the model again)")
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--executor", choices=("inprocess", "workers"), default="inprocess",
                    help="workers: one process per GPU, chunks relayed by NCCL sends (memory/relay.py)")
    args = ap.parse_args(argv)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not have or max(args.gpus) > have:
        print(f"needs {max(args.gpus)} CUDA GPUs, this machine has {have}", file=sys.stderr)
        return 2
    if args.chunk is None:
        args.chunk = [32] if args.executor == "workers" else [16, 32, 64]
    if args.executor == "workers":
        return main_workers(args)
    cfg, _ = resolve_model(args.model)
    t0 = time.perf_counter()
    image = HostImage(layout_for(cfg), pin=True)
    image.fill_random(cfg, 0, "cuda:0")
    res = {"machine": machine(), "settings": vars(args), "model": args.model, "startup_s": time.perf_counter() - t0,
           "runs": []}
    rows = []
    med = statistics.median
    for k in args.gpus:
        r = measure(image, k, args.chunk, args.repeats)
        res["runs"].append(r)
        one, kk, plain = med(r["raw_one_link_s"]), med(r["raw_k_links_s"]), med(r["plain_swap_s"])
        rows.append([k, "plain", plain * 1e3, one * 1e3, kk * 1e3, one / plain, kk / plain,
                     med(r["plain_first_group_s"]) * 1e3, r["plain_bytes_equal"]])
        for c, s in r["striped"].items():
            t = med(s["swap_s"])
            rows.append([k, f"striped {c} MiB", t * 1e3, one * 1e3, kk * 1e3, one / t, kk / t,
                         med(s["first_group_s"]) * 1e3, s["bytes_equal"] and s["staging_held_after"] == 0])
    gpu = torch.cuda.get_device_name(0).lower().replace("nvidia ", "").split()[0]
    out = args.out or f"bench/results/striped_swap_{gpu}.json"
    write_json(out, res)
    print_table(f"striped swap-in of {args.model} ({image.nbytes / 1e9:.2f} GB) onto GPU 0, medians (ms)",
                ["GPUs", "swap", "swap ms", "1-link raw ms", "k-link raw ms", "x one link", "of k links",
                 "first group ms", "bytes equal, staging back"], rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
