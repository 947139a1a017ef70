"""The per-collective cost of tensor parallelism, measured in the run whose layouts it predicts.

What flows through: a number of ranks ``t`` and a few (layer shape, micro-batch) pairs go in; ``t``
processes start on this machine (``dist.spawn``: one per GPU, NCCL; gloo on the CPU), each builds
the trainer's decoder layer for its tp shard (``profile.runtime_layer``, the layer ``plan profile``
times) and times a chain of copies of it, forward and backward with the gradients added into
float32 accumulators, the way ``profile.measure`` does, twice: alone (the collectives absent, what
the profile measures) and with the reduce the trainer installs at tp > 1 (``collectives.tp_reduce``:
an all-reduce after the attention's and the MLP's row-parallel projection forward, and of their
gradients backward). A counting pass says how many all-reduces one layer issues (4). Out comes, per
shape, each rank's per-layer time in the group and alone and ``per_collective_s`` = (group - alone)
/ all-reduces, at least 0: what one collective costs the step, its ring time, its host's issue and
the wait for the group's slowest rank together. On CUDA the same chain is also replayed as one CUDA
graph, alone and in the group (``profile.replayed``, as ``computron train --cuda-graphs`` runs a
micro-batch): ``group_graph_s``, ``alone_graph_s`` and ``per_collective_graph_s``, what a collective
costs a graphed step, where no host issues anything.

:func:`derive` turns that into the planner's ``Assumptions.tp_collective_s`` for ``t``: the cost
beyond the ring time the planner already charges for the same message (``costs.ring_allreduce``
on one node of the planner's GPU type), the median over the shapes, at least 0; and from the graphed
timings ``Assumptions.tp_collective_graphed_s`` the same way.
"""

from __future__ import annotations

import json
import statistics


def measure(ranks: int, device: str, dtype: str, shapes, warmup: int = 3, repeats: int = 10,
            depth: int | None = None) -> dict:
    """Time the trainer's tp layer over ``ranks`` processes here (see the module docstring).
    ``shapes``: (planner ``TransformerShape``, micro-batch) pairs; ``depth``: layers chained (default:
    ``profile.chain_depth``). {"ranks", "backend", "entries": [{"model", "seq_len", "mbs", "bytes",
    "depth", "allreduces_per_layer", "group_s", "alone_s", "group_s_by_rank", "alone_s_by_rank",
    "per_collective_s"}]}, times per layer (forward plus backward)."""
    import tempfile

    from .dist import spawn

    if ranks < 2:
        raise ValueError(f"a tensor-parallel group has 2 or more ranks, got {ranks}")
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/tpcoll.json"
        spawn(ranks, _rank, device, dtype, list(shapes), warmup, repeats, depth, path)
        with open(path) as f:
            return json.load(f)


def _count(layer, reduce, x) -> int:
    """The all-reduces one forward and backward of ``layer`` issues with ``reduce`` installed: each
    call forward, and each backward through its output."""
    n = [0]

    def counted(y):
        n[0] += 1
        out = reduce(y)
        out.register_hook(lambda g: n.__setitem__(0, n[0] + 1))
        return out

    _install(layer, counted)
    layer(x).sum().backward()
    _install(layer, None)
    for p in layer.parameters():
        p.grad = None
    return n[0]


def _install(layer, reduce) -> None:
    """Set the reduce hooks of ``runtime_layer``'s decoder layer (None: no collectives)."""
    layer.layer.attn.reduce = layer.layer.mlp.reduce = reduce


def _rank(device: str, dtype: str, shapes, warmup: int, repeats: int, depth: int | None, path: str) -> int:
    """One rank of :func:`measure` (``dist.spawn`` sets its environment); rank 0 writes the result."""
    import torch
    import torch.distributed as tdist

    from ..parallel.collectives import tp_reduce
    from ..planner.profile import chain_depth, measure as timed, runtime_layer
    from . import dist

    device = dist.local_device(device)
    dist.init(device, 300.0)
    n, dev, dt = tdist.get_world_size(), torch.device(device), getattr(torch, dtype)
    reduce = tp_reduce(tdist.group.WORLD)
    rows = []
    for m, mbs in shapes:
        torch.manual_seed(0)
        layer = runtime_layer(m, n, dev, dt)
        if layer is None:
            raise ValueError(f"{m.name}: the trainer cannot run this shape (dropout or unfused attention)")
        d = chain_depth(layer) if depth is None else depth
        x = torch.randn(mbs, m.seq_len, m.hidden, device=dev, dtype=dt, requires_grad=True)
        count = _count(layer, reduce, x)
        del x
        tdist.barrier()
        alone = timed(layer, mbs, m, dev, dt, warmup, repeats, accumulate=True, depth=d, step=False)
        _install(layer, reduce)
        tdist.barrier()
        group = timed(layer, mbs, m, dev, dt, warmup, repeats, accumulate=True, depth=d, step=False)
        rows.append({"model": m.name, "seq_len": m.seq_len, "mbs": mbs, "depth": d, "allreduces_per_layer": count,
                     "bytes": mbs * m.seq_len * m.hidden * torch.finfo(dt).bits // 8,
                     "group_s": group["fwd_s"] + group["bwd_s"], "alone_s": alone["fwd_s"] + alone["bwd_s"],
                     "group_graph_s": group["graph_s"], "alone_graph_s": alone["graph_s"]})
        del layer
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    every = [None] * n
    tdist.all_gather_object(every, rows)
    if tdist.get_rank() == 0:
        entries = []
        for i, r in enumerate(rows):
            g, a = [e[i]["group_s"] for e in every], [e[i]["alone_s"] for e in every]
            group_s, alone_s = statistics.fmean(g), statistics.fmean(a)
            entries.append({**r, "group_s": group_s, "alone_s": alone_s, "group_s_by_rank": g, "alone_s_by_rank": a,
                            "per_collective_s": max(0.0, (group_s - alone_s) / r["allreduces_per_layer"])})
            if r["group_graph_s"] is not None:  # CUDA: the same of the graphed replays
                g, a = [e[i]["group_graph_s"] for e in every], [e[i]["alone_graph_s"] for e in every]
                group_s, alone_s = statistics.fmean(g), statistics.fmean(a)
                entries[-1].update(group_graph_s=group_s, alone_graph_s=alone_s, per_collective_graph_s=max(
                    0.0, (group_s - alone_s) / r["allreduces_per_layer"]))
        with open(path, "w") as f:
            json.dump({"ranks": n, "backend": tdist.get_backend(), "entries": entries}, f)
    dist.close()
    return 0


def derive(measured: dict, gpu: str, a) -> dict:
    """``measured`` (:func:`measure`) with, per entry, ``ring_s`` (the planner's ring time for its
    message over ``ranks`` GPUs of type ``gpu`` under assumptions ``a``) and ``tp_collective_s`` (its
    ``per_collective_s`` beyond that, at least 0), and ``tp_collective_s`` over all: their median; where
    the entries have ``per_collective_graph_s``, ``tp_collective_graphed_s`` the same of those."""
    from ..planner import costs
    from ..planner.hardware import load_cluster

    t = measured["ranks"]
    bw = load_cluster(f"{gpu}:{t}x1").node_types[0].intra_bw * a.intra_eff
    entries = []
    for e in measured["entries"]:
        ring = costs.ring_allreduce(e["bytes"], t, bw, a.intra_latency_s)
        entries.append({**e, "ring_s": ring, "tp_collective_s": max(0.0, e["per_collective_s"] - ring)})
        if e.get("per_collective_graph_s") is not None:
            entries[-1]["tp_collective_graphed_s"] = max(0.0, e["per_collective_graph_s"] - ring)
    out = {**measured, "gpu": gpu, "entries": entries,
           "tp_collective_s": statistics.median(e["tp_collective_s"] for e in entries)}
    if all("tp_collective_graphed_s" in e for e in entries):
        out["tp_collective_graphed_s"] = statistics.median(e["tp_collective_graphed_s"] for e in entries)
    return out


def shapes_by_tp(configs, models: dict, search: bool) -> dict[int, list[tuple[str, int, int]]]:
    """{t: [(model, seq_len, mbs)]}: the tensor-parallel sizes to measure and the shapes to measure each
    at. The sizes: every tp > 1 of ``configs``, and with ``search`` every tp > 1 the planner's search
    may take on their GPU counts (``pick.trainer_tps``); the shapes of a size: its configurations'
    (model, sequence length, micro-batch), or when none runs it, those of every configuration whose
    GPUs and model allow it."""
    from .accuracy import shape_of
    from .pick import trainer_tps

    def allowed(c) -> tuple[int, ...]:
        return trainer_tps(shape_of(models[c.model], c.seq_len, 1), c.world)

    tps = {c.tp for c in configs if c.tp > 1}
    if search:
        tps |= {t for c in configs for t in allowed(c) if t > 1}
    out = {}
    for t in sorted(tps):
        at = [c for c in configs if c.tp == t] or [c for c in configs if t in allowed(c)]
        out[t] = list(dict.fromkeys((c.model, c.seq_len, c.mbs) for c in at))
    return out


def run(configs, models: dict, gpu: str, device: str, dtype: str, a, search: bool = True, log=print) -> list[dict]:
    """:func:`measure` and :func:`derive` for every size of :func:`shapes_by_tp`; a measurement that
    fails gives {"ranks", "error"} (the planner then takes the fallback for that size)."""
    from .accuracy import shape_of

    out = []
    for t, want in shapes_by_tp(configs, models, search).items():
        shapes = [(shape_of(models[model], seq, 1), mbs) for model, seq, mbs in want]
        try:
            got = derive(measure(t, device, dtype, shapes), gpu, a)
        except (RuntimeError, ValueError) as e:  # a rank failed (dist.RankFailed), or a shape refused
            log(f"tp collective over {t} ranks: {e}")
            out.append({"ranks": t, "error": str(e)})
            continue
        for e in got["entries"]:
            log(f"tp collective over {t} ranks ({got['backend']}) {e['model']} s={e['seq_len']} mbs={e['mbs']}: "
                f"{_line(e)}")
        log(f"tp collective over {t} ranks: tp_collective_s = {got['tp_collective_s'] * 1e6:.0f} us"
            + (f", graphed {got['tp_collective_graphed_s'] * 1e6:.0f} us" if "tp_collective_graphed_s" in got else ""))
        out.append(got)
    return out


def by_tp(groups: list[dict], graphed: bool = False) -> dict[int, float]:
    """{t: tp_collective_s} (``graphed``: ``tp_collective_graphed_s``) of the measurements in ``groups``
    (:func:`run`) that did not fail and have it."""
    key = "tp_collective_graphed_s" if graphed else "tp_collective_s"
    return {g["ranks"]: g[key] for g in groups if "error" not in g and key in g}


def _line(e: dict) -> str:
    graphed = "" if "tp_collective_graphed_s" not in e else (
        f"; as CUDA graphs {e['group_graph_s'] * 1e3:.3f} ms in the group, {e['alone_graph_s'] * 1e3:.3f} ms alone, "
        f"{e['per_collective_graph_s'] * 1e6:.0f} us a collective, "
        f"{e['tp_collective_graphed_s'] * 1e6:.0f} us beyond the ring")
    return (f"a layer {e['group_s'] * 1e3:.3f} ms in the group, {e['alone_s'] * 1e3:.3f} ms alone, "
            f"{e['allreduces_per_layer']} all-reduces of {e['bytes'] / 2**20:.2f} MiB: {e['per_collective_s'] * 1e6:.0f} us "
            f"each, {e['ring_s'] * 1e6:.0f} us of it the planner's ring, {e['tp_collective_s'] * 1e6:.0f} us beyond"
            + graphed)


def print_report(tp: dict, out=print) -> None:
    """The measured per-collective cost of each tp size, and which value the predictions used."""
    for g in tp["groups"]:
        if "error" in g:
            out(f"tp collective over {g['ranks']} ranks: not measured: {g['error']}")
            continue
        out(f"tp collective over {g['ranks']} ranks ({g['backend']}): tp_collective_s {g['tp_collective_s'] * 1e6:.0f} us")
        for e in g["entries"]:
            out(f"  {e['model']} s={e['seq_len']} mbs={e['mbs']}: {_line(e)}")
    measured = ", ".join(f"tp={t} {s * 1e6:.0f} us" for t, s in tp["measured_by_tp"].items())
    out(f"tp collective cost used: {measured + '; ' if measured else ''}fitted {tp['fallback_s'] * 1e6:.0f} us "
        f"{'for any other tp' if measured else 'throughout (nothing measured)'}")
    graphed = ", ".join(f"tp={t} {s * 1e6:.0f} us" for t, s in tp.get("graphed_by_tp", {}).items())
    out(f"  in CUDA graphs (--cuda-graphs): {graphed + '; ' if graphed else ''}the ring alone "
        f"{'for any other tp' if graphed else 'throughout (nothing measured)'}")
