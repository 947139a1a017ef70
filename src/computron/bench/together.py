"""Several models a step, through the engine: how much of each extra model's decode step a shared step
costs (``Calibration.concurrent_step_fraction``), measured as the simulator uses it.

K copies of one model (random weights, each its own seed) are resident under two engines on the
same device, one stepping one model at a time (``models_per_step`` 1) and one stepping all K
together (``models_per_step`` K). Each model gets ``batch`` requests of ``prompt`` tokens making
``new`` greedy tokens at once; tokens per second of all K from the submission to the last token,
the two engines alternating, medians of ``repeats``. A step of K identical models costs, in the
simulator, one step plus the fraction f of each other's, so the speed-up x of together over one at a
time is K / (1 + f (K - 1)), and f = (K / x - 1) / (K - 1).
"""

from __future__ import annotations

import statistics
import time


def fraction_from_speedup(k: int, speedup: float) -> float:
    """The shared-step fraction that makes a step of ``k`` equal models ``speedup`` times faster than
    one model a step: 1 when nothing overlaps, 0 when the others cost nothing (clamped to [0, 1])."""
    if k < 2:
        raise ValueError(f"a shared step needs at least 2 models, got {k}")
    if speedup <= 0:
        raise ValueError(f"speed-up must be positive, got {speedup!r}")
    return min(1.0, max(0.0, (k / speedup - 1) / (k - 1)))


def tokens_per_s(eng, names: list[str], batch: int, new: int, prompts: list[list[int]]) -> float:
    """Decode tokens a second of ``batch`` requests to each of ``names``, all submitted at once."""
    from ..engine import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = [eng.submit(n, prompts[i], params) for n in names for i in range(batch)]
    eng.run_until_done(reqs)
    for r in reqs:
        if r.error or len(r.output_ids) != new:
            raise RuntimeError(f"request to {r.model}: {r.error or f'{len(r.output_ids)} tokens, not {new}'}")
    return len(reqs) * new / (time.perf_counter() - t0)


def engines(model: str, k: int, batch: int, new: int, device: str, prompt: int = 128) -> dict:
    """The two engines (``models_per_step`` 1 and ``k``), each with ``k`` copies of ``model`` loaded."""
    from ..config import EngineConfig, ModelSpec
    from ..engine import Engine
    from ..memory.layout import layout_for
    from ..models import resolve_model

    cfg, _ = resolve_model(model)
    nbytes = layout_for(cfg).nbytes
    workspace = 2 * 2**30 if device != "cpu" else 64 * 2**20
    kv = k * batch * (prompt + new + 32) * cfg.kv_bytes_per_token()  # every request's cache at once
    out = {}
    for per_step in (1, k):
        eng = out[per_step] = Engine(EngineConfig(
            device=device, gpu_memory_budget=workspace + k * nbytes + kv + nbytes // 4 + 2**20,
            workspace_bytes=workspace, max_batch_size=max(batch, 1), models_per_step=per_step))
        for i in range(k):
            eng.register_model(ModelSpec(model, alias=f"m{i}", seed=i))
            eng.load(f"m{i}", wait=True)
    return out


def measure(engs: dict, k: int, batch: int, new: int, repeats: int, vocab: int, prompt: int = 128) -> dict:
    """Tokens a second one model a step and ``k`` together (alternating, after a warm-up that captures
    the batch's graphs), the speed-up and the fraction it implies."""
    import torch

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (batch, prompt), generator=g).tolist()
    names = [f"m{i}" for i in range(k)]
    for eng in engs.values():
        tokens_per_s(eng, names, batch, 4, prompts)
    got: dict[int, list[float]] = {1: [], k: []}
    for _ in range(repeats):  # alternating: a drift of the machine hits both alike
        for per_step, eng in engs.items():
            got[per_step].append(tokens_per_s(eng, names, batch, new, prompts))
    one, together = statistics.median(got[1]), statistics.median(got[k])
    return {"models": k, "batch": batch, "tokens_per_s_one_a_step": got[1], "tokens_per_s_together": got[k],
            "speedup": together / one, "fraction": fraction_from_speedup(k, together / one),
            "steps_together": engs[k].executor.status().stats.get("steps_together", 0)}


def shared_step_fraction(model: str, device: str, k: int = 2, batch: int = 1, new: int = 64,
                         repeats: int = 3) -> dict:
    """``measure`` with its own two engines, shut down afterwards."""
    from ..models import resolve_model

    engs = engines(model, k, batch, new, device)
    try:
        return {"model": model, **measure(engs, k, batch, new, repeats, resolve_model(model)[0].vocab_size)}
    finally:
        for eng in engs.values():
            eng.executor.shutdown()
