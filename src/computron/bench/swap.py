"""``computron bench swap MODEL``: how fast one model moves from pinned host memory onto the device.

Measured in one run, each the median of ``--repeats``:
- the reference: one raw pinned host→device memcpy of the same bytes from the model's own host
  image into free memory of the same arena (the executor's ``probe_link``); with ``--tp``/``--pp``
  every rank copies its own shard at once, each repeat timed by its slowest rank (aggregate);
- swap-in: the engine's swapper (per-layer-group copies on its copy stream), from its first to
  last byte by CUDA events, and its bandwidth as a fraction of the reference;
- eviction: wall time of releasing the model (nothing is copied back);
- time to first token of a prompt, cold (swap-in included) and warm (resident), with a CUDA-event
  trace of the cold run: when each layer's compute started against when its copy ended;
- the naive baseline: ``module.to(device)`` of the same weights from pageable memory (``--no-naive``
  skips it: for a large model it takes longer than everything else);
- batch-1 decode ms/token, warm, beside ``transformers``' ``generate`` on the same device when it
  is installed and the model is OPT-shaped.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..config import EngineConfig, ModelSpec
from ..engine import Engine, SamplingParams
from ..memory.host import HostImage
from ..memory.layout import layout_for
from ..models import resolve_model
from ..models.transformer import DecoderLM, bind_weights
from .common import machine, print_table, sync, write_json


def _median(xs):
    return statistics.median(xs) if xs else None


def _ttft(eng: Engine, name: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    req = eng.submit(name, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    eng.run_until_done([req])  # the token came back to the host: the device work is done
    if req.error:
        raise RuntimeError(f"{name}: the timed request failed: {req.error}")
    return req.first_token_at - t0


def run(model: str, device: str, repeats: int, prompt_len: int, decode_tokens: int,
        executor: str = "inprocess", tp: int = 1, pp: int = 1, naive_baseline: bool = True) -> dict:
    cfg, _ = resolve_model(model)
    layout = layout_for(cfg)
    k = tp * pp
    kv = (prompt_len + max(decode_tokens, 1) + 32) * cfg.kv_bytes_per_token()  # whole 16-token blocks
    workspace = 4 * 2**30 if device != "cpu" else 256 * 2**20
    eng = Engine(EngineConfig(device=device, gpu_memory_budget=workspace + layout.nbytes + kv + 2**20,
                              workspace_bytes=workspace, executor="workers" if k > 1 else executor, devices=k))
    t0 = time.perf_counter()
    eng.register_model(ModelSpec(model, tp=tp, pp=pp))
    startup_s = time.perf_counter() - t0
    nbytes = eng.models[model].nbytes  # every rank's shard together (a sharded model repeats its norms)
    dev = torch.device(device)
    raw = eng.executor.probe_link(model, repeats + 1)[1:]
    events: list[tuple[str, float]] = []
    eng.listeners.append(lambda kind, name, s, n: events.append((kind, s)))

    swap, evict = [], []
    for _ in range(repeats + 1):
        events.clear()
        eng.load(model, wait=True)
        swap += [s for k, s in events if k == "load"]
        t0 = time.perf_counter()
        eng.offload(model)
        evict.append(time.perf_counter() - t0)
    swap, evict = swap[1:], evict[1:]

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist()
    cold, warm = [], []
    for _ in range(repeats + 1):
        eng.offload(model)
        cold.append(_ttft(eng, model, prompt))
        warm.append(_ttft(eng, model, prompt))
    cold, warm = cold[1:], warm[1:]
    overlap = None
    if dev.type == "cuda" and executor == "inprocess" and k == 1:
        # One more cold start with the executor's trace on, to line compute up against copies.
        eng.offload(model)
        eng.core.trace = True
        _ttft(eng, model, prompt)
        eng.core.trace = False
        tr = eng.core.last_trace[model]
        overlap = {**tr, "layer0_compute_starts_before_last_copy_ends":
                   tr["compute_start_s"][1] < tr["copy_end_s"][-1]}

    naive = []
    if dev.type == "cuda" and naive_baseline:
        # The same weights (same seed, generated the same way) in pageable memory, moved by .to().
        pageable = HostImage(layout, pin=False)
        pageable.fill_random(cfg, 0, dev)
        m = DecoderLM(cfg)
        bind_weights(m, pageable.views)
        for _ in range(max(2, repeats // 2)):
            sync(dev)
            t0 = time.perf_counter()
            m.to(dev)
            sync(dev)
            naive.append(time.perf_counter() - t0)
            m.to("cpu")  # back to pageable memory for the next round
        del m, pageable

    decode = _decode_ms(eng, model, prompt, decode_tokens)
    hf = _hf_decode_ms(cfg, dev, prompt, decode_tokens) if decode_tokens and k == 1 else None

    eng.executor.shutdown()
    med_raw, med_swap = _median(raw), _median(swap)
    return {
        "model": model, "bytes": nbytes, "device": str(dev), "startup_s": startup_s,
        "raw_memcpy_s": raw, "raw_memcpy_gbps": nbytes / med_raw / 1e9,
        "swap_in_s": swap, "swap_in_gbps": nbytes / med_swap / 1e9, "swap_over_raw_bandwidth": med_raw / med_swap,
        "evict_s": evict, "ttft_cold_s": cold, "ttft_warm_s": warm, "prompt_len": prompt_len,
        "cold_ttft_budget_s": med_swap + 0.5 * _median(warm),
        "cold_ttft_within_budget": _median(cold) <= med_swap + 0.5 * _median(warm),
        "naive_to_device_s": naive, "overlap_trace": overlap,
        "decode_ms_per_token": decode, "transformers_decode_ms_per_token": hf,
        "executor": "workers" if k > 1 else executor, "tp": tp, "pp": pp,
    }


def _decode_ms(eng: Engine, model: str, prompt: list[int], n: int) -> float | None:
    if not n:
        return None
    times = []
    for _ in range(3):
        req = eng.submit(model, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        eng.run_until_done([req])
        times.append((req.finished_at - req.first_token_at) / max(1, n - 1) * 1e3)
    return _median(times)


def _hf_decode_ms(cfg, dev, prompt, n) -> float | None:
    """transformers' generate, greedy, batch 1, same shape and dtype, random weights, same device."""
    try:
        import transformers
    except ImportError:
        return None
    if cfg.family != "opt":
        return None
    hf_cfg = transformers.OPTConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                    num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                                    ffn_dim=cfg.ffn_size, max_position_embeddings=cfg.max_position,
                                    word_embed_proj_dim=cfg.embed_proj_dim or cfg.hidden_size,
                                    do_layer_norm_before=cfg.pre_norm)
    dtype = getattr(torch, cfg.dtype)
    with torch.device(dev):
        model = transformers.OPTForCausalLM(hf_cfg).to(dtype).eval()
    ids = torch.tensor([prompt], device=dev)
    times = []
    for _ in range(3):
        with torch.inference_mode():
            sync(dev)
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            sync(dev)
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            sync(dev)
            t2 = time.perf_counter()
        times.append(((t2 - t1) - (t1 - t0)) / max(1, n - 1) * 1e3)
    del model
    return _median(times)


def main(args) -> int:
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    results = {"machine": machine(), "settings": vars(args) | {"func": None}, "models": {}}
    rows = []
    for model in args.model:
        r = run(model, device, args.repeats, args.prompt_len, args.decode_tokens, args.executor, args.tp, args.pp,
                not args.no_naive)
        results["models"][model] = r
        rows.append([model, r["bytes"] / 1e9, _median(r["raw_memcpy_s"]), _median(r["swap_in_s"]),
                     r["swap_over_raw_bandwidth"], _median(r["evict_s"]) * 1e3, _median(r["ttft_cold_s"]),
                     _median(r["ttft_warm_s"]), _median(r["naive_to_device_s"]) if r["naive_to_device_s"] else "-",
                     r["decode_ms_per_token"] or "-", r["transformers_decode_ms_per_token"] or "-"])
    layout = f"_tp{args.tp}_pp{args.pp}" if args.tp * args.pp > 1 else ""
    out = args.out or f"bench/results/swap_{'_'.join(args.model)}{layout}.json"
    write_json(out, results)
    print_table("swap (medians)", ["model", "GB", "raw memcpy s", "swap-in s", "swap/raw bw", "evict ms",
                                   "TTFT cold s", "TTFT warm s", "naive .to s", "decode ms/tok", "HF ms/tok"], rows)
    print(f"wrote {out}")
    return 0

