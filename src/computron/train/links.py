"""Communication the planner assumes against what this machine's ranks achieve.

What flows through: a number of ranks, a device and message sizes go in. :func:`measure` starts
that many processes here (``dist.spawn``, one GPU each over NCCL, or gloo on the CPU) and times,
per size, an all-reduce (a maximum: the bytes and steps of a sum, while repeated runs stay
finite) of a random float32 buffer over all of them and a ping-pong of send/recv between
neighbouring pairs (0-1, 2-3, ... at once, as pipeline stages send): after a warm-up, the median
over repeats of a few back-to-back operations each; and the host seconds one all-reduce call takes
to return (NCCL: its issue alone, the device still running it), the host's share of the
per-collective cost a host-bound step pays (``Assumptions.tp_collective_s``). Out come the
all-reduce's time and bus bandwidth (algorithm bandwidth ``size / time`` times ``2(n-1)/n``, as nccl-tests reports it) and
the one-way send's time and bandwidth (half a round trip). :func:`assumed` reads what the cost
model uses for the same ranks on one node of the planner's GPU type, from the same place it does
(``layout.stage_envs``: the data-parallel ring's and the pipeline link's bandwidth and latency),
and :func:`compare` puts each size's measurement beside the planner's time for it
(``costs.ring_allreduce``, ``costs.send_time``).
"""

from __future__ import annotations

import json
import statistics
import time

MIB = 1 << 20
GPU_SIZES = (1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
CPU_SIZES = (64 << 10, 256 << 10, 1 * MIB)


def bus_factor(n: int) -> float:
    """Bytes each rank moves per byte all-reduced by a ring: 2(n-1)/n."""
    return 2.0 * (n - 1) / n


def assumed(gpu: str, ranks: int, a) -> dict:
    """What the cost model (assumptions ``a``) takes for ``ranks`` GPUs of type ``gpu`` on one node:
    the bus bandwidth and per-step latency of a ring over all of them (a data-parallel gradient
    all-reduce) and the bandwidth and latency of one send to the next stage (pipeline), bytes/s and s."""
    from ..parallel.dims import ParallelDims
    from ..planner.hardware import load_cluster
    from ..planner.layout import stage_envs

    node = (load_cluster(f"{gpu}:{ranks}x1").node_types[0],)
    ring = stage_envs(node, ParallelDims(dp=ranks), a)[0]
    pipe = stage_envs(node, ParallelDims(pp=ranks), a)[0]
    return {"gpu": gpu, "ranks": ranks, "allreduce_bus_bw": ring.dp_bw, "allreduce_step_latency_s": ring.dp_latency,
            "p2p_bw": pipe.next_bw, "p2p_latency_s": a.p2p_latency_s}


def compare(measured: dict, assume: dict, a) -> dict:
    """Each size of ``measured`` (:func:`measure`) beside the planner's time and bandwidth for it, and
    the largest size's measured bandwidths as fractions of the assumed ones."""
    from ..planner import costs

    n, rows = measured["ranks"], []
    for m in measured["sizes"]:
        size = m["bytes"]
        ar = costs.ring_allreduce(size, n, assume["allreduce_bus_bw"], assume["allreduce_step_latency_s"])
        p2p = costs.send_time(size, assume["p2p_bw"], a)
        rows.append({**m, "allreduce_assumed_s": ar, "allreduce_assumed_bus_bw": bus_factor(n) * size / ar,
                     "p2p_assumed_s": p2p, "p2p_assumed_bw": size / p2p})
    last = rows[-1]
    return {"ranks": n, "backend": measured["backend"], "assumed": assume, "sizes": rows,
            "largest_allreduce_fraction": last["allreduce_bus_bw"] / assume["allreduce_bus_bw"],
            "largest_p2p_fraction": last["p2p_bw"] / assume["p2p_bw"]}


def measure(ranks: int, device: str, sizes=None, warmup: int = 3, repeats: int = 10, inner: int = 5) -> dict:
    """All-reduce and send/recv over ``ranks`` processes on this machine (see the module docstring):
    {"ranks", "backend", "sizes": [{"bytes", "allreduce_s", "allreduce_bus_bw", "allreduce_issue_s", "p2p_s",
    "p2p_bw"}]}."""
    import tempfile

    from .dist import spawn

    if ranks < 2:
        raise ValueError(f"links are measured between 2 or more ranks, got {ranks}")
    sizes = tuple(sizes or (GPU_SIZES if device.startswith("cuda") else CPU_SIZES))
    if any(s < 4 for s in sizes):
        raise ValueError(f"message sizes must be at least 4 bytes (one float32), got {list(sizes)}")
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/links.json"
        spawn(ranks, _rank, device, sizes, warmup, repeats, inner, path)
        with open(path) as f:
            return json.load(f)


def _rank(device: str, sizes, warmup: int, repeats: int, inner: int, path: str) -> int:
    """One rank of :func:`measure` (``dist.spawn`` sets its environment); rank 0 writes the result."""
    import torch
    import torch.distributed as tdist

    from . import dist

    device = dist.local_device(device)
    dist.init(device, 300.0)
    rank, n = tdist.get_rank(), tdist.get_world_size()
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    peer = rank ^ 1  # pairs 0-1, 2-3, ...; with an odd count the last rank has none

    def timed(op) -> float:
        """Median seconds of one ``op`` over ``repeats`` runs of ``inner`` back-to-back ones, all ranks
        starting together, after ``warmup`` such runs."""
        out = []
        for i in range(warmup + repeats):
            sync()
            tdist.barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                op()
            sync()
            if i >= warmup:
                out.append((time.perf_counter() - t0) / inner)
        return statistics.median(out)

    def issued(op) -> float:
        """Median host seconds one ``op`` call takes to return, all ranks starting together."""
        out = []
        for i in range(warmup + repeats):
            sync()
            tdist.barrier()
            t0 = time.perf_counter()
            op()
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        sync()
        return statistics.median(out)

    def ping_pong(x):
        if peer >= n:
            return
        if rank % 2 == 0:
            tdist.send(x, peer)
            tdist.recv(x, peer)
        else:
            tdist.recv(x, peer)
            tdist.send(x, peer)

    rows = []
    for size in sizes:
        x = torch.rand(size // 4, dtype=torch.float32, device=dev)  # random: never time zeros
        # MAX moves the bytes a sum does, and repeated reductions of it stay finite
        ar = timed(lambda: tdist.all_reduce(x, op=tdist.ReduceOp.MAX))
        issue = issued(lambda: tdist.all_reduce(x, op=tdist.ReduceOp.MAX))
        p2p = timed(lambda: ping_pong(x)) / 2  # one way: half a round trip
        nbytes = x.numel() * 4
        rows.append({"bytes": nbytes, "allreduce_s": ar, "allreduce_bus_bw": bus_factor(n) * nbytes / ar,
                     "allreduce_issue_s": issue, "p2p_s": p2p, "p2p_bw": nbytes / p2p})
        del x
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"ranks": n, "backend": tdist.get_backend(), "sizes": rows}, f)
    dist.close()
    return 0


def run(ranks: int, gpu: str, device: str, a, sizes=None, log=print) -> dict:
    """:func:`measure` here and :func:`compare` it with the planner's assumptions for ``gpu``; a
    measurement that fails gives {"ranks", "error"} (the configurations are still measured)."""
    try:
        got = compare(measure(ranks, device, sizes), assumed(gpu, ranks, a), a)
    except RuntimeError as e:  # a rank failed (dist.RankFailed)
        log(f"links over {ranks} ranks: {e}")
        return {"ranks": ranks, "error": str(e)}
    log(f"links over {ranks} ranks ({got['backend']}): " + "; ".join(
        f"{r['bytes'] / MIB:g} MiB all-reduce {r['allreduce_bus_bw'] / 1e9:.1f} GB/s bus, send {r['p2p_bw'] / 1e9:.1f} GB/s"
        for r in got["sizes"]))
    return got


def print_report(links: list[dict], out=print) -> None:
    for g in links:
        if "error" in g:
            out(f"links over {g['ranks']} ranks: not measured: {g['error']}")
            continue
        s = g["assumed"]
        out(f"links over {g['ranks']} ranks ({g['backend']}) against the planner's {s['gpu']} node: all-reduce bus "
            f"{s['allreduce_bus_bw'] / 1e9:.0f} GB/s + {s['allreduce_step_latency_s'] * 1e6:.0f} us a ring step, send "
            f"{s['p2p_bw'] / 1e9:.0f} GB/s + {s['p2p_latency_s'] * 1e6:.0f} us")
        out(f"  {'size':>9}  {'all-reduce bus GB/s':>20} {'(planner)':>9}  {'send GB/s':>9} {'(planner)':>9}")
        for r in g["sizes"]:
            out(f"  {r['bytes'] / MIB:>5.4g} MiB  {r['allreduce_bus_bw'] / 1e9:>20.2f} {r['allreduce_assumed_bus_bw'] / 1e9:>9.2f}"
                f"  {r['p2p_bw'] / 1e9:>9.2f} {r['p2p_assumed_bw'] / 1e9:>9.2f}")
        out(f"  largest size: all-reduce {g['largest_allreduce_fraction']:.0%} and send {g['largest_p2p_fraction']:.0%} "
            "of the planner's bandwidth")
