"""Why a sharded model's load in the round-robin takes longer than in ``bench swap``.

On four H200s, OPT-13B at tp=4 loaded in 139 ms in ``computron bench swap`` (the same copy
reloaded, nothing else running) and in 158 ms a request in ``computron bench round-robin`` (two
copies alternating, each load followed by the request's prefill and decode). This bench separates
the differences, all in one engine (the default policy, the worker executor, a budget for one copy),
the kinds of load interleaved round by round so drift hits them alike:

- ``reload``: the copy just evicted loaded again (what ``bench swap`` times);
- ``alternate``: the other copy loaded (a second host image, as the round-robin alternates);
- ``request``: the other copy loaded by a request, its prefill waiting on each layer's copy and its
  decode after (what the round-robin times);
- ``tiny``: the same with a one-token prompt and one output token (the copy with hardly any compute
  beside it).

Each load is reported by its slowest rank's copy events (first to last byte), with every rank's own
time; the reference is the raw pinned memcpy of every rank's shard at once (``probe_link``), in the
same run. Medians over ``--rounds``.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 bench/load_gap.py --model opt-13b --tp 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from computron.bench.common import machine, positive_int, print_table, write_json
from computron.config import EngineConfig, ModelSpec
from computron.engine import Engine, SamplingParams
from computron.memory.host import HUGE_PAGES_ENV
from computron.models import resolve_model
from computron.parallel.dims import ParallelDims
from computron.parallel.shard_model import rank_bytes

KINDS = ("reload", "alternate", "request", "tiny")


def huge_pages_in_use(pids) -> int:
    """Bytes of transparent huge pages the processes ``pids`` hold (0 where the kernel says nothing)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += sum(int(line.split()[1]) * 1024 for line in f if line.startswith("AnonHugePages:"))
        except OSError:
            pass
    return total


def run(model: str, tp: int, pp: int, rounds: int, prompt_len: int, max_tokens: int, device: str,
        huge: bool = False) -> dict:
    os.environ[HUGE_PAGES_ENV] = "1" if huge else "0"  # the workers, started now, inherit it
    cfg, _ = resolve_model(model)
    nbytes = max(rank_bytes(cfg, ParallelDims(tp=tp, pp=pp)))
    kv = (prompt_len + max_tokens + 32) * cfg.kv_bytes_per_token()
    workspace = 2 * 2**30 if device != "cpu" else 64 * 2**20
    eng = Engine(EngineConfig(device=device, gpu_memory_budget=workspace + nbytes + kv + nbytes // 4,
                              workspace_bytes=workspace, max_loaded=1, executor="workers", devices=tp * pp))
    names = [f"{model}#{i}" for i in range(2)]
    for i, name in enumerate(names):
        eng.register_model(ModelSpec(model, alias=name, seed=i, tp=tp, pp=pp))
    ex = eng.executor
    thp = huge_pages_in_use(ex.worker_pids().values())
    raw = {name: ex.probe_link(name, rounds + 1)[1:] for name in names}
    loads: list[float] = []
    eng.listeners.append(lambda kind, name, s, n: loads.append(s) if kind == "load" else None)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist()
    cur = names[0]
    eng.load(cur, wait=True)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    images: dict[str, list[int]] = {k: [] for k in KINDS}
    ranks: dict[str, list[dict[int, float]]] = {k: [] for k in KINDS}

    def switch(to: str) -> None:  # untimed: make ``to`` the resident copy
        nonlocal cur
        if cur != to:
            eng.offload(cur)
            eng.load(to, wait=True)
            cur = to

    def one(kind: str, image: int) -> None:
        nonlocal cur
        target = names[image]
        switch(target if kind == "reload" else names[1 - image])  # reload: the copy just evicted
        if kind in ("reload", "alternate"):
            eng.offload(cur)
            loads.clear()
            eng.load(target, wait=True)
            sec = loads[-1]
        else:
            p, n = (prompt, max_tokens) if kind == "request" else (prompt[:1], 1)
            req = eng.submit(target, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            eng.run_until_done([req])
            if req.error:
                raise RuntimeError(f"{target}: {req.error}")
            sec = req.load_s
        cur = target
        times[kind].append(sec)
        images[kind].append(image)
        ranks[kind].append(dict(ex.rank_loads[target]))

    for k in KINDS:  # warm-up: every path once on each image (graph captures, first pins)
        for i in (0, 1):
            one(k, i)
    for v in (*times.values(), *images.values(), *ranks.values()):
        v.clear()
    for r in range(rounds):  # each kind loads each image alike, in an order that turns round by round
        for k in KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]:
            one(k, (r + KINDS.index(k)) % 2)
    ex.shutdown()
    med = statistics.median
    ref = med(raw[names[0]] + raw[names[1]])
    by_image = {k: {names[i]: med([t for t, im in zip(times[k], images[k]) if im == i] or [float("nan")])
                    for i in (0, 1)} for k in KINDS}
    out = {"model": model, "tp": tp, "pp": pp, "rank_bytes_max": nbytes, "rounds": rounds, "huge_pages": huge,
           "huge_page_bytes_in_workers": thp,
           "raw_concurrent_memcpy_s": raw, "raw_median_s": ref,
           "raw_median_by_image_s": {n: med(v) for n, v in raw.items()},
           "loads_s": times, "load_images": images, "rank_loads_s": ranks,
           "median_s": {k: med(v) for k, v in times.items()},
           "median_by_image_s": by_image,
           "median_over_raw": {k: med(v) / ref for k, v in times.items()},
           "rank_median_s": {k: {d: med(r[d] for r in rs) for d in rs[0]} for k, rs in ranks.items()}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="opt-13b")
    ap.add_argument("--tp", type=positive_int, default=4)
    ap.add_argument("--pp", type=positive_int, default=1)
    ap.add_argument("--rounds", type=positive_int, default=8, help="loads of each kind (default 8)")
    ap.add_argument("--prompt-len", type=positive_int, default=128)
    ap.add_argument("--max-tokens", type=positive_int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pages", nargs="+", choices=("small", "huge"), default=["small", "huge"],
                    help="host images on 4 KiB pages, on transparent 2 MiB ones (COMPUTRON_HOST_HUGE_PAGES), "
                         "each in an engine of its own, one after the other (default: both)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    res = {"machine": machine(), "settings": vars(a),
           "transparent_hugepage": open(thp).read().strip() if os.path.exists(thp) else None, "pages": {}}
    for pages in a.pages:
        res["pages"][pages] = r = run(a.model, a.tp, a.pp, a.rounds, a.prompt_len, a.max_tokens, a.device,
                                      huge=pages == "huge")
        raw = r["raw_median_by_image_s"]
        rows = [[k, r["median_s"][k] * 1e3, r["median_over_raw"][k],
                 *(r["median_by_image_s"][k][n] * 1e3 for n in raw),
                 " ".join(f"{v * 1e3:.1f}" for v in r["rank_median_s"][k].values())] for k in KINDS]
        rows.append(["raw memcpy", r["raw_median_s"] * 1e3, 1.0, *(v * 1e3 for v in raw.values()), ""])
        print_table(f"{a.model} tp={a.tp} pp={a.pp}, {pages} pages ({r['huge_page_bytes_in_workers'] / 2**30:.1f} "
                    f"GiB huge in the workers): load (slowest rank), ms",
                    ["kind", "ms", "over raw", *(f"{n} ms" for n in raw), "each rank's ms"], rows)
    out = a.out or f"bench/results/load_gap_{a.model}_tp{a.tp}_pp{a.pp}.json"
    write_json(out, res)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
