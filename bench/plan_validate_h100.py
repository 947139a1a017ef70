"""Published H100 training configurations that ran, given to ``plan estimate`` exactly as published:
does the planner judge each one to fit (with its default 10% margin, and within the whole card
less its 1 GiB reserve), and (where a time was published) how far is its estimate?

Sources (facts quoted, not fitted; nothing here was used to choose a constant):
- NVIDIA Megatron-Bridge performance recipes for DGX-H100 (``megatron/bridge/perf_recipes/llama/h100/
  llama3.py`` and ``llama31.py``): the layouts of the published pre-training benchmarks. Llama 3 8B on
  8 GPUs: tp 1, pp 1, cp 2, micro-batch 1, global batch 128; Llama 3 70B on 64 GPUs, bf16: tp 4, pp 4,
  cp 2, virtual stages 5, sequence parallelism, micro-batch 1, global batch 256; Llama 3 70B on 64
  GPUs, fp8 (current scaling): tp 4, pp 8, cp 1, virtual stages 5, sequence parallelism, global batch
  256; Llama 3.1 405B on 1,024 GPUs, bf16: tp 8, pp 8, cp 2, virtual stages 8, sequence parallelism,
  micro-batch 1, global batch 1,536. All at 8,192 tokens (the recipes' user-buffer configurations
  and ``seq_length``), with Megatron's distributed optimizer (ZeRO-1 over the data-parallel and
  context ranks) and gradients reduced in bf16 (the Llama 3 performance configs set
  ``grad_reduce_in_fp32`` off: the planner's default 16 bytes a parameter). No recomputation is set.
  The fp8 run's precision preset (``fp8_cs``: Megatron-Bridge's ``bf16_with_fp8_current_scaling_mixed``
  with its bf16 first and last layers turned off) keeps the weights in fp8 (``fp8_param_gather``),
  which the planner assumes with ``--fp8`` (``Assumptions.fp8_params``). Megatron splits layers evenly over the pp x v chunks
  (``--partition`` below); 405B's 126 layers do not divide into its 64 chunks and the recipe's
  split is not given, so the planner's own partition stands in for it. These rows are checked for
  fit only.
- NVIDIA NeMo AutoModel performance summary, DGX-H100, BF16: Llama 3 70B on 64 GPUs, global batch
  128, micro-batch 1 (4 accumulation steps), 8,192 tokens, tp 1, pp 1, cp 2, FSDP over 32 ranks,
  "TE + fsdp2_prefetch": 18.90 s per global step. The table does not say whether activations are
  checkpointed; a 70B layer's activations at 4,096 tokens a rank cannot all be kept in 80 GB, so
  full recomputation is assumed (said in the output). AutoModel's FSDP2 default mixed-precision
  policy computes in bf16 and reduces gradients in fp32 (``FSDP2Config.mp_policy``):
  ``--bytes-per-param 18`` (fp32 gradients).

Llama 3.1 405B's shape (126 layers, hidden 16,384, 128 heads, 8 key/value heads, FFN 53,248,
vocabulary 128,256) is from the Llama 3 paper (Dubey et al. 2024, Table 3).

    python bench/plan_validate_h100.py   -> bench/results/plan_validate_h100.json
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from computron.planner.cli import main as plan  # noqa: E402

L405 = dict(name="llama-3.1-405b", family="llama", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248,
            vocab=128256, seq_len=8192, global_batch=1536)

# label, model, cluster, global batch, plan estimate flags, published seconds per iteration (or None)
ROWS = [
    ("Megatron-Bridge Llama 3 8B bf16, 8 GPUs", "llama-3-8b", "h100:8x1", 128,
     "--tp 1 --pp 1 --dp 4 --cp 2 --mbs 1 --zero 1", None),
    ("Megatron-Bridge Llama 3 70B bf16, 64 GPUs", "llama-3-70b", "h100:8x8", 256,
     "--tp 4 --pp 4 --dp 2 --cp 2 --mbs 1 --zero 1 --virtual-stages 5 --sequence-parallel --partition 20,20,20,20",
     None),
    ("Megatron-Bridge Llama 3 70B fp8, 64 GPUs", "llama-3-70b", "h100:8x8", 256,
     "--tp 4 --pp 8 --dp 2 --mbs 1 --zero 1 --virtual-stages 5 --sequence-parallel --fp8 "
     "--partition 10,10,10,10,10,10,10,10", None),
    ("Megatron-Bridge Llama 3.1 405B bf16, 1,024 GPUs", "405b", "h100:8x128", 1536,
     "--tp 8 --pp 8 --dp 8 --cp 2 --mbs 1 --zero 1 --virtual-stages 8 --sequence-parallel", None),
    ("NeMo AutoModel Llama 3 70B bf16 FSDP, 64 GPUs (full recomputation assumed)", "llama-3-70b", "h100:8x8", 128,
     "--tp 1 --pp 1 --dp 32 --cp 2 --mbs 1 --zero 3 --recompute full --bytes-per-param 18", 18.90),
]


def estimate(model: str, cluster: str, global_batch: int, flags: str, tmp: str) -> dict:
    out = os.path.join(tmp, "plan.json")
    args = ["estimate", "--model", model, "--cluster", cluster, "--global-batch", str(global_batch),
            *flags.split(), "--json", out]
    with open(os.devnull, "w") as null:
        streams, sys.stdout, sys.stderr = (sys.stdout, sys.stderr), null, null
        try:
            plan(args)
        finally:
            sys.stdout, sys.stderr = streams
    with open(out) as f:
        return json.load(f)


def validate(log=print) -> list[dict]:
    """Every published row estimated: fits (default margin), fits_card, and the time error where published."""
    from computron.planner.costs import DEFAULT

    reserve, rows = DEFAULT.memory_reserve_gib * 2**30, []
    with tempfile.TemporaryDirectory() as tmp:
        l405 = os.path.join(tmp, "405b.yaml")
        with open(l405, "w") as f:
            f.write("".join(f"{k}: {v}\n" for k, v in L405.items()))
        for label, model, cluster, gb, flags, published in ROWS:
            got = estimate(l405 if model == "405b" else model, cluster, gb, flags, tmp)
            d = got["detail"]
            card = min(c - reserve for c in d["stage_capacity"])  # the whole card less CUDA context and NCCL
            row = {"run": label, "cluster": cluster, "global_batch": gb, "flags": flags, "fits": got["feasible"],
                   "fits_card": max(d["stage_memory"]) <= card, "card_gib": card / 2**30,
                   "max_mem_gib": got["max_mem_gib"], "usable_gib": min(float(x) for x in
                                                                         str(got["usable_per_stage_gib"]).split("/")),
                   "predicted_s": got["iteration_s"], "published_s": published}
            if published:
                row["error"] = got["iteration_s"] / published - 1
            rows.append(row)
            err = f", predicted {got['iteration_s']:.2f} s against {published:.2f} s ({row['error']:+.1%})" \
                if published else ""
            log(f"{label}: {'fits' if row['fits'] else 'does NOT fit'} ({row['max_mem_gib']:.1f} GiB on the"
                  f" fullest stage, {row['usable_gib']:.1f} usable with the default margin; "
                  f"{'within' if row['fits_card'] else 'over'} the card's {row['card_gib']:.1f}){err}")
    return rows


def main() -> int:
    rows = validate()
    out = os.path.join(HERE, "results", "plan_validate_h100.json")
    with open(out, "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "rows": rows, "all_fit": all(r["fits"] for r in rows),
                   "all_fit_card": all(r["fits_card"] for r in rows)}, f, indent=1)
    print(f"{sum(r['fits'] for r in rows)} of {len(rows)} published configurations fit with the default margin, "
          f"{sum(r['fits_card'] for r in rows)} within the card; wrote {out}")
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
