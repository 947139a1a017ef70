"""Where a training step's time goes, per layout (one GPU or several): one step of ``computron.train`` under the PyTorch
profiler on every rank, after warm-up steps, beside the step's wall time.

For each ``--config`` (the ``bench plan-accuracy`` syntax, MODEL:MBS:GLOBAL_BATCH:SEQ_LEN[:full][@tp=..,pp=..,dp=..])
it reports, for rank 0 and the slowest rank: the step's wall time, the time some kernel ran on the
GPU (the union of kernel intervals, so overlapping streams count once), the part of it in NCCL
kernels, the host time spent inside CUDA launches, and the operators with the most device and host
time. A step whose GPU is busy for a small part of its wall time is bound by the host (launches,
Python, waiting); one whose NCCL kernels fill it, by communication. ``--cuda-graphs both`` runs each
layout eagerly and with the trainer's CUDA graphs (``computron train --cuda-graphs``), in turn.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 bench/train_profile.py \\
        --config gpt2-large:4:32:1024@tp=2 --config gpt2-large:4:32:1024@tp=4 --out bench/results/train_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

TOP = 12


def _family(name: str) -> str:
    """An NCCL kernel's family without its type and algorithm suffixes (``ncclDevKernel_SendRecv``,
    ``ncclDevKernel_AllReduce_Sum_bf16_RING_LL`` -> ``AllReduce``)."""
    rest = name.split("ncclDevKernel_", 1)[-1].split("ncclKernel_", 1)[-1]
    return rest.split("_", 1)[0].split("(", 1)[0]


def profile_step(tr, device: str, trace: str | None = None) -> dict:
    """One training step of ``tr`` under the profiler: its wall time and where it went; ``trace``: also its
    timeline, written there (Chrome trace format, gzipped)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from computron.train.profile import union_s

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        rec = tr.train_step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    events = prof.events()
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    nccl = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
    compute = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()]
    families: dict[str, list[float]] = {}
    for e in kernels:  # kernels only (the GPU timeline also carries annotations such as nccl:all_reduce)
        if e.name.startswith(("ncclDevKernel_", "ncclKernel_")):
            families.setdefault(_family(e.name), []).append(e.time_range.end - e.time_range.start)
    launches = sum(e.cpu_time_total for e in events if e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC",
                                                                  "cuLaunchKernel", "cudaMemcpyAsync"))
    avg = prof.key_averages()

    def top(key: str) -> list[dict]:
        rows = sorted(avg, key=lambda a: getattr(a, key), reverse=True)[:TOP]
        return [{"op": a.key, "calls": a.count, "self_device_ms": a.self_device_time_total / 1e3,
                 "self_cpu_ms": a.self_cpu_time_total / 1e3} for a in rows]

    if trace:
        import gzip
        import shutil

        prof.export_chrome_trace(trace)
        with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(trace)
    return {"step_s": rec["time_s"], "kernels": len(kernels), "gpu_busy_s": union_s(spans),
            "nccl_busy_s": union_s(nccl), "compute_busy_s": union_s(compute),
            "nccl_kernels": {k: {"calls": len(v), "device_ms": sum(v) / 1e3, "p50_us": sorted(v)[len(v) // 2]}
                             for k, v in sorted(families.items())}, "launch_cpu_s": launches / 1e6,
            "top_device": top("self_device_time_total"), "top_cpu": top("self_cpu_time_total")}


def _run_here(cfg, device: str, warmup: int, graphs: bool = False, trace: str | None = None) -> dict:
    from computron.train.config import TrainConfig
    from computron.train.job import Trainer

    tr = Trainer(TrainConfig(model=cfg.model, seq_len=cfg.seq_len, global_batch=cfg.global_batch, micro_batch=cfg.mbs,
                             steps=warmup + 1, recompute=cfg.recompute, device=device,
                             dtype="bfloat16" if device.startswith("cuda") else "float32",
                             dims={"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp}, virtual_stages=cfg.v, zero1=cfg.zero1,
                             cuda_graphs=graphs,
                             synthetic_tokens=(cfg.global_batch * (warmup + 2) + 1) * cfg.seq_len + 1))
    walls = [tr.train_step()["time_s"] for _ in range(warmup)]
    out = profile_step(tr, device, trace and f"{trace}/{cfg.label.replace(' ', '_')}{'_graphs' * graphs}"
                       f"_rank{os.environ.get('RANK', '0')}.json")
    out["warmup_step_s"] = walls
    tr.close()  # its graphs go before the process group does (a live one makes its teardown wait)
    return out


def _rank(cfg, device: str, warmup: int, graphs: bool, folder: str, trace: str | None = None) -> int:
    from computron.train import dist

    device = dist.local_device(device)
    dist.init(device, 300.0)
    out = _run_here(cfg, device, warmup, graphs, trace)
    with open(f"{folder}/rank{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(out, f)
    dist.close()
    return 0


def run(label: str, device: str, warmup: int, graphs: bool = False, trace: str | None = None) -> dict:
    from computron.train.accuracy import Config
    from computron.train.dist import spawn

    cfg = Config.parse(label)
    t0 = time.perf_counter()
    if cfg.world == 1:
        ranks = [_run_here(cfg, device, warmup, graphs, trace)]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            spawn(cfg.world, _rank, cfg, device, warmup, graphs, tmp, trace)
            ranks = [json.load(open(f"{tmp}/rank{r}.json")) for r in range(cfg.world)]
    slow = max(range(len(ranks)), key=lambda r: ranks[r]["step_s"])
    return {"config": cfg.label + " graphs" * graphs, "cuda_graphs": graphs, "wall_s": time.perf_counter() - t0,
            "slowest_rank": slow, "ranks": ranks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cuda-graphs", choices=("off", "on", "both"), default="off",
                    help="the trainer's CUDA graphs (computron train --cuda-graphs); both: each layout twice")
    ap.add_argument("--out", default="bench/results/train_profile.json")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="also write each rank's timeline of the profiled step there (<layout>_rank<R>.json.gz)")
    args = ap.parse_args(argv)
    from computron.bench.common import machine, write_json
    from computron.train.accuracy import Config

    try:  # every layout read before any runs
        for label in args.config:
            Config.parse(label)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    res = {"machine": machine(), "settings": vars(args), "runs": []}
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graphs]
    for label, graphs in ((c, g) for c in args.config for g in modes):
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
        r = run(label, args.device, args.warmup, graphs, args.trace)
        res["runs"].append(r)
        for name, k in (("rank 0", 0), (f"rank {r['slowest_rank']} (slowest)", r["slowest_rank"])):
            x = r["ranks"][k]
            print(f"{r['config']} {name}: step {x['step_s'] * 1e3:.1f} ms, GPU busy {x['gpu_busy_s'] * 1e3:.1f} ms "
                  f"({x['nccl_busy_s'] * 1e3:.1f} in NCCL, {x['compute_busy_s'] * 1e3:.1f} computing), {x['kernels']} kernels, "
                  f"launches {x['launch_cpu_s'] * 1e3:.1f} ms of host time; unprofiled steps "
                  f"{', '.join(f'{w * 1e3:.0f}' for w in x['warmup_step_s'])} ms")
            for fam, v in x["nccl_kernels"].items():
                print(f"    NCCL {fam}: {v['calls']} kernels, {v['device_ms']:.1f} ms, p50 {v['p50_us']:.0f} us")
        for t in r["ranks"][0]["top_device"][:6]:
            print(f"    {t['op'][:60]:60s} x{t['calls']:5d} device {t['self_device_ms']:8.2f} ms cpu {t['self_cpu_ms']:8.2f} ms")
        write_json(args.out, res)  # after each layout: a later one that fails loses nothing
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
