"""The classic Computron experiment: N copies of a model, R requests sent round-robin, a memory
budget that holds one copy, so every request forces a swap. Per-request load, evict, compute and
response times (mean, median, p99) for each policy; several policies are run on the same
workload in the same process, so their ratios compare like with like.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from ..config import EngineConfig, ModelSpec
from ..engine import Engine, SamplingParams
from ..parallel.dims import ParallelDims
from ..parallel.shard_model import rank_bytes
from ..models import resolve_model
from .common import machine, print_table, summary, write_json


def run_policy(model: str, n: int, r: int, policy: str, blocking: bool, prompt_len: int, max_tokens: int,
               device: str, warmup: int = 2, tp: int = 1, pp: int = 1) -> dict:
    cfg, _ = resolve_model(model)
    k = tp * pp
    nbytes = max(rank_bytes(cfg, ParallelDims(tp=tp, pp=pp)))  # the largest rank's shard of one copy
    kv = (prompt_len + max_tokens + 32) * cfg.kv_bytes_per_token() * (1 if blocking else r)
    workspace = 2 * 2**30 if device != "cpu" else 64 * 2**20
    budget = workspace + nbytes + kv + nbytes // 4  # room for one copy, never two
    eng = Engine(EngineConfig(device=device, gpu_memory_budget=budget, workspace_bytes=workspace, policy=policy,
                              max_loaded=1, executor="workers" if k > 1 else None, devices=k))
    for i in range(n):
        eng.register_model(ModelSpec(model, alias=f"{model}#{i}", seed=i, tp=tp, pp=pp))
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(r + warmup)]
    names = [f"{model}#{i % n}" for i in range(r + warmup)]
    done = []
    if blocking:
        for i, (name, p) in enumerate(zip(names, prompts)):
            req = eng.submit(name, p, params)
            eng.run_until_done([req])  # its tokens reached the host: the device work is done
            done.append(req)
    else:
        for name, p in zip(names[:warmup], prompts[:warmup]):
            eng.run_until_done([eng.submit(name, p, params)])
        reqs = [eng.submit(name, p, params) for name, p in zip(names[warmup:], prompts[warmup:])]
        eng.run_until_done(reqs)
        done = [None] * warmup + reqs
    done = done[warmup:]
    for req in done:
        if req.error:
            raise RuntimeError(f"request failed: {req.error}")
    rows = {
        "load": summary([q.load_s for q in done]),
        "evict": summary([q.evict_s for q in done]),
        "compute": summary([q.compute_s for q in done]),
        "response": summary([q.finished_at - q.arrival for q in done]),
    }
    out = {"policy": policy, "tp": tp, "pp": pp, "model_bytes": eng.models[f"{model}#0"].nbytes,
           "swap_ins": eng.stats["swap_ins"], "evictions": eng.stats["evictions"], "budget_per_device": budget,
           "times_s": rows}
    eng.executor.shutdown()
    return out


def main(args) -> int:
    device = args.device
    results = {"machine": machine(), "settings": {k: getattr(args, k) for k in
               ("model", "n", "r", "blocking", "prompt_len", "max_tokens", "device", "tp", "pp")}, "policies": {}}
    # Each policy runs in a fresh process on the same workload: host memory (pinned or not) and the
    # device are returned to the system between them, and neither inherits the other's caches.
    # (A process pool of non-daemonic workers: with --tp/--pp the engine starts worker processes of its own.)
    ctx = multiprocessing.get_context("spawn")
    for pol in args.policy:
        t0 = time.perf_counter()
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            results["policies"][pol] = pool.submit(run_policy, args.model, args.n, args.r, pol, args.blocking,
                                                   args.prompt_len, args.max_tokens, device, 2,
                                                   args.tp, args.pp).result()
        results["policies"][pol]["wall_s"] = time.perf_counter() - t0
    rows = []
    for pol, res in results["policies"].items():
        t = res["times_s"]
        rows.append([pol] + [t[k][s] for k in ("load", "evict", "compute", "response") for s in ("mean", "median", "p99")])
    if "default" in results["policies"] and "computron" in results["policies"]:
        d, c = results["policies"]["default"]["times_s"], results["policies"]["computron"]["times_s"]
        results["ratios_default_over_computron"] = {
            k: {s: (d[k][s] / c[k][s] if c[k][s] else None) for s in ("mean", "median", "p99")}
            for k in ("load", "evict", "compute", "response")}
    layout = f"_tp{args.tp}_pp{args.pp}" if args.tp * args.pp > 1 else ""
    out = args.out or f"bench/results/round_robin_{args.model}{layout}_n{args.n}_r{args.r}.json"
    write_json(out, results)
    print_table(f"round-robin {args.model} n={args.n} r={args.r} {'blocking' if args.blocking else 'all at once'} "
                f"(seconds; mean / median / p99)",
                ["policy"] + [f"{k} {s}" for k in ("load", "evict", "compute", "response") for s in ("mean", "med", "p99")],
                rows)
    print(f"wrote {out}")
    return 0

