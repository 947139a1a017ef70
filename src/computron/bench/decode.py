"""``computron bench decode MODEL...``: how fast one resident model generates, by batch size.

For each batch size, ``B`` requests of ``--prompt-len`` random prompt tokens and
``--new-tokens`` greedy tokens are submitted at once (all prefilled in the first step), and the
decode steps that follow are timed: step time = (last token − first token) / (new tokens − 1),
tokens/s = B / step time; the median of ``--repeats`` runs. With several ``--decode-steps``
values (steps per engine call, each step's tokens fed to the next on the device), each is
measured on the same engine, alternating within every repeat. Measured in the same run:

- the weight-read floor: one pass reading as many bytes as the model's weights on the same
  device (a reduction over a buffer of that size): no decode step can be faster;
- ``transformers`` eager ``generate`` (when installed) on a model of the same shape and dtype with
  random weights, same batch and lengths, timed the same way (decode time per step).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from ..config import EngineConfig, ModelSpec
from ..engine import Engine, SamplingParams
from ..memory.layout import layout_for
from ..models import resolve_model
from .common import machine, print_table, sync, write_json


def weight_read_floor_s(nbytes: int, device: torch.device, repeats: int = 10) -> float:
    """Seconds to read ``nbytes`` once (median): the least a step that reads every weight can take."""
    buf = torch.ones(nbytes // 2, dtype=torch.float16, device=device)
    times = []
    for _ in range(repeats + 2):
        sync(device)
        t0 = time.perf_counter()
        buf.sum(dtype=torch.float32)
        sync(device)
        times.append(time.perf_counter() - t0)
    del buf
    return statistics.median(times[2:])


def _engine_step_s(eng: Engine, model: str, batch: int, prompts: list[list[int]], new: int) -> float:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    reqs = [eng.submit(model, p, params) for p in prompts[:batch]]
    eng.run_until_done(reqs)
    first, last = max(r.first_token_at for r in reqs), max(r.finished_at for r in reqs)
    assert all(len(r.output_ids) == new for r in reqs)
    return (last - first) / (new - 1)


def _hf_model(cfg, device):
    try:
        import transformers
    except ImportError:
        return None
    dtype = getattr(torch, cfg.dtype)
    if cfg.family == "opt":
        hf = transformers.OPTConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                    num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                                    ffn_dim=cfg.ffn_size, max_position_embeddings=cfg.max_position,
                                    word_embed_proj_dim=cfg.embed_proj_dim or cfg.hidden_size,
                                    do_layer_norm_before=cfg.pre_norm)
        kind = transformers.OPTForCausalLM
    elif cfg.family == "llama":
        hf = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                                      num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.ffn_size,
                                      max_position_embeddings=cfg.max_position, rope_theta=cfg.rope_theta,
                                      rms_norm_eps=cfg.norm_eps)
        kind = transformers.LlamaForCausalLM
    else:
        return None
    with torch.device(device):
        return kind(hf).to(dtype).eval()


def _hf_step_s(model, batch: int, prompts: list[list[int]], new: int, device) -> float:
    ids = torch.tensor(prompts[:batch], device=device)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        sync(device)
        t1 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)
        sync(device)
        t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / (new - 1)


def run(model: str, device: str, batches: list[int], prompt_len: int, new: int, repeats: int,
        reference: bool, decode_steps: list[int] = (1,)) -> dict:
    cfg, _ = resolve_model(model)
    nbytes = layout_for(cfg).nbytes
    dev = torch.device(device)
    top = max(batches)
    kv = top * (prompt_len + new + 32) * cfg.kv_bytes_per_token()
    workspace = 8 * 2**30 if dev.type == "cuda" else 512 * 2**20
    eng = Engine(EngineConfig(device=device, gpu_memory_budget=workspace + nbytes + kv + 2**24,
                              workspace_bytes=workspace, max_batch_size=top,
                              max_tokens_per_step=top * prompt_len))
    eng.register_model(ModelSpec(model))
    eng.load(model, wait=True)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (top, prompt_len), generator=g).tolist()
    _engine_step_s(eng, model, min(batches), prompts, min(new, 8))  # warm-up
    rows, runs = {}, {k: {} for k in decode_steps}
    for b in batches:
        times = {k: [] for k in decode_steps}
        for k in decode_steps:  # warm-up: this batch's graph bucket is captured outside the timing
            eng.config.decode_steps = k
            _engine_step_s(eng, model, b, prompts, min(new, 2 * k + 2))
        for _ in range(repeats):
            for k in decode_steps:  # alternate: a drift of the machine hits every setting alike
                eng.config.decode_steps = k
                times[k].append(_engine_step_s(eng, model, b, prompts, new))
        for k in decode_steps:
            runs[k][b] = {"step_s": times[k], "step_s_median": statistics.median(times[k]),
                          "tokens_per_s": b / statistics.median(times[k])}
        rows[b] = runs[decode_steps[0]][b]
    floor = weight_read_floor_s(nbytes, dev)
    hf = _hf_model(cfg, dev) if reference else None
    if hf is not None:
        _hf_step_s(hf, min(batches), prompts, 4, dev)  # warm-up
        for b in batches:
            steps = [_hf_step_s(hf, b, prompts, new, dev) for _ in range(max(1, repeats - 1))]
            rows[b]["transformers_step_s_median"] = statistics.median(steps)
            rows[b]["transformers_tokens_per_s"] = b / statistics.median(steps)
            rows[b]["speedup_over_transformers"] = rows[b]["transformers_step_s_median"] / rows[b]["step_s_median"]
        del hf
    for k in decode_steps:
        b1 = runs[k][min(batches)]["step_s_median"]
        for b in batches:
            row = runs[k][b]
            row["step_over_floor"] = row["step_s_median"] / floor
            row["step_over_smallest_batch"] = row["step_s_median"] / b1
            if "transformers_step_s_median" in rows[b]:
                row["speedup_over_transformers"] = rows[b]["transformers_step_s_median"] / row["step_s_median"]
    return {"model": model, "weight_bytes": nbytes, "executor_stats": eng.executor.status().stats, "dtype": cfg.dtype,
            "prompt_len": prompt_len, "new_tokens": new, "weight_read_floor_s": floor,
            "weight_read_gbps": nbytes / floor / 1e9, "batches": rows,
            "by_decode_steps": {str(k): runs[k] for k in decode_steps}}


def main(args) -> int:
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    results = {"machine": machine(), "settings": {k: getattr(args, k) for k in
               ("model", "batch", "prompt_len", "new_tokens", "repeats", "device", "decode_steps")}, "models": {}}
    table = []
    for model in args.model:
        steps = list(dict.fromkeys(args.decode_steps))
        if max(steps) > 64:
            print(f"error: --decode-steps must be from 1 to 64, got {max(steps)}", file=sys.stderr)
            return 2
        r = run(model, device, sorted(set(args.batch)), args.prompt_len, args.new_tokens, args.repeats,
                not args.no_reference, steps)
        results["models"][model] = r
        for k in steps:
            for b, row in r["by_decode_steps"][str(k)].items():
                hf = r["batches"][b].get("transformers_step_s_median")
                table.append([model, b, k, row["step_s_median"] * 1e3, row["tokens_per_s"], row["step_over_floor"],
                              row["step_over_smallest_batch"], hf * 1e3 if hf else "-",
                              row.get("speedup_over_transformers", "-")])
    out = args.out or f"bench/results/decode_{'_'.join(args.model)}.json"
    write_json(out, results)
    print_table("decode (medians)", ["model", "batch", "steps/call", "step ms", "tok/s", "step/floor", "step/step(b=min)",
                                     "HF step ms", "HF step / ours"], table)
    print(f"wrote {out}")
    return 0
