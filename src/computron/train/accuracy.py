"""``computron bench plan-accuracy``: training layouts measured on this machine against ``plan estimate``.

What flows through: a list of configurations (model preset, micro-batch, global batch, sequence
length, recomputation, and a layout: tp, pp, dp, interleaving, ZeRO-1) runs one at a time through
the ``Trainer`` (a layout of several ranks as that many processes on this machine's devices, one
GPU each; a few warm-up steps, then the median step time and the peak memory of the measured
steps, the largest over the ranks); the planner's cost model (``planner/``, with a ``plan
profile`` of this GPU when given, else its roofline) predicts the same layout and layer partition
on one node of as many GPUs of the named type. Out come a table, a JSON with
each configuration's errors and the summary (mean and worst absolute time error, mean memory
error, Spearman rank correlation of predicted and measured times, the best model TFLOP/s against
this device's measured matrix rate), and a PNG of predicted against measured.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass

# GPT-shaped models from 125M to 1.3B, micro-batch, global batch, recomputation and sequence varied
DEFAULT_CONFIGS = ["gpt2:4:32:1024", "gpt2:8:32:1024", "gpt2:8:32:1024:full", "gpt2:16:64:512",
                   "gpt2-medium:4:32:1024", "gpt2-medium:8:32:1024:full", "gpt2-large:4:16:1024",
                   "gpt2-large:8:32:512:full", "gpt2-xl:2:16:1024", "gpt2-xl:4:16:1024:full"]


FORMAT = "MODEL:MBS:GLOBAL_BATCH:SEQ_LEN[:full][@tp=T,pp=P,dp=D,v=V,zero1]"


@dataclass(frozen=True)
class Config:
    model: str
    mbs: int
    global_batch: int
    seq_len: int
    recompute: bool = False
    tp: int = 1
    pp: int = 1
    dp: int = 1
    v: int = 1  # model chunks per pipeline stage (interleaved 1F1B)
    zero1: bool = False

    @classmethod
    def parse(cls, text: str) -> "Config":
        head, _, layout = text.partition("@")
        parts = head.split(":")
        if len(parts) not in (4, 5) or (len(parts) == 5 and parts[4] != "full"):
            raise ValueError(f"configuration {text!r}: expected {FORMAT}")
        kw = {}
        for item in filter(None, layout.split(",")):
            key, _, value = item.partition("=")
            if key == "zero1" and not value:
                kw["zero1"] = True
            elif key in ("tp", "pp", "dp", "v") and value.isdigit() and int(value) >= 1:
                kw[key] = int(value)
            else:
                raise ValueError(f"configuration {text!r}: {item!r} is not tp=, pp=, dp=, v= (a positive integer) "
                                 f"or zero1; expected {FORMAT}")
        return cls(parts[0], int(parts[1]), int(parts[2]), int(parts[3]), len(parts) == 5, **kw)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def label(self) -> str:
        layout = "" if self.world == 1 else f" tp{self.tp} pp{self.pp} dp{self.dp}" + f" v{self.v}" * (self.v > 1) + \
            " zero1" * self.zero1
        return f"{self.model} mbs={self.mbs} gb={self.global_batch} s={self.seq_len}" + " rc" * self.recompute + layout


def shape_of(c, seq_len: int, global_batch: int):
    """The planner's shape of an engine ``ModelConfig`` as this trainer runs it (fused attention, no dropout)."""
    from ..planner.model import TransformerShape

    return TransformerShape(c.name, "llama" if c.family == "llama" else "gpt", c.num_layers, c.hidden_size,
                            c.num_heads, c.ffn_size, c.vocab_size, seq_len, global_batch, kv_heads=c.kv_heads,
                            dtype="bfloat16", tie_embeddings=c.tie_embeddings, flash_attention=True, dropout=False)


def predict(shape, gpu: str, cfg: Config, profile: str | None) -> tuple[float, float]:
    """(iteration seconds, peak bytes) the planner gives for one GPU of type ``gpu``."""
    from ..parallel.dims import ParallelDims
    from ..planner.costs import Assumptions
    from ..planner.estimate import CostModel, PlanConfig, PlanContext
    from ..planner.hardware import load_cluster
    from ..planner.layout import stage_envs
    from ..planner.measured import load_profile

    from ..parallel.sharding import stage_layers

    # the trainer keeps bf16 weight copies, float32 gradients, masters and AdamW moments: 18 bytes a parameter
    cm = CostModel(shape, Assumptions(bytes_per_param=18), load_profile(profile, gpu) if profile else None)
    dims = ParallelDims(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp)
    placement = (load_cluster(f"{gpu}:{cfg.world}x1").node_types[0],)
    ctx = PlanContext(cm, stage_envs(placement, dims, cm.a),
                      PlanConfig(dims, cfg.mbs, cfg.v, cfg.recompute, cfg.zero1, False, False, False))
    chunks = stage_layers(shape.layers, cfg.pp * cfg.v)  # the trainer's uniform partition; chunk c on stage c % pp
    counts = [sum(len(chunks[c]) for c in range(s, cfg.pp * cfg.v, cfg.pp)) for s in range(cfg.pp)]
    r = ctx.result(ctx.check_counts(counts), "given", placement)
    return r.iteration_s, max(r.stage_memory)


def measure(cfg: Config, device: str, dtype: str, warmup: int, steps: int) -> dict:
    """Median step time, peak bytes (the largest rank's) and model TFLOP/s per GPU of ``cfg``; a
    layout of several ranks runs as that many processes here (``dist.spawn``), rank 0 reporting."""
    from ..models import resolve_model

    if cfg.world == 1:
        out = _measure_here(cfg, device, dtype, warmup, steps)
    else:
        import tempfile

        from .dist import spawn

        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/rank0.json"
            spawn(cfg.world, _measure_rank, cfg, device, dtype, warmup, steps, path)
            with open(path) as f:
                out = json.load(f)
    out["shape"] = resolve_model(cfg.model, dtype="float32")[0]
    return out


def _measure_here(cfg: Config, device: str, dtype: str, warmup: int, steps: int) -> dict:
    from .config import TrainConfig
    from .job import Trainer

    tr = Trainer(TrainConfig(model=cfg.model, seq_len=cfg.seq_len, global_batch=cfg.global_batch, micro_batch=cfg.mbs,
                             steps=warmup + steps, recompute=cfg.recompute, device=device, dtype=dtype,
                             dims={"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp}, virtual_stages=cfg.v, zero1=cfg.zero1,
                             synthetic_tokens=(cfg.global_batch * (warmup + steps) + 1) * cfg.seq_len + 1))
    recs = [tr.train_step() for _ in range(warmup + steps)][warmup:]
    out = {"time_s": statistics.median(r["time_s"] for r in recs), "peak_bytes": max(max(r["peak_bytes"]) for r in recs),
           "tflops_per_gpu": statistics.median(r["tflops_per_gpu"] for r in recs)}
    del tr, recs
    import gc

    import torch

    gc.collect()  # the trainer's cycles (hooks, colocation callbacks) hold its GPU memory until collected:
    if torch.cuda.is_available():  # the next configuration's peak would count it
        torch.cuda.empty_cache()
    return out


def _measure_rank(cfg: Config, device: str, dtype: str, warmup: int, steps: int, path: str) -> int:
    """One rank of a layout's measurement (``dist.spawn`` sets its environment)."""
    import os

    from . import dist

    device = dist.local_device(device)
    dist.init(device, 300.0)
    out = _measure_here(cfg, device, dtype, warmup, steps)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(path, "w") as f:
            json.dump(out, f)
    dist.close()
    return 0


def matmul_tflops(device: str, dtype: str) -> float:
    """The device's measured dense matrix rate (TFLOP/s) in ``dtype``."""
    import torch

    dev, n = torch.device(device), (8192 if device.startswith("cuda") else 512)
    a = torch.randn(n, n, device=dev, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, device=dev, dtype=a.dtype)
    for _ in range(3):
        a @ b
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for i, j in enumerate(order):
            r[j] = float(i)
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else 0.0


def profile_layers(configs: list[Config], gpu: str, device: str, dtype: str, out: str, log=print) -> dict:
    """``plan profile`` of this device for every (model, sequence length, tp) the configurations use, at
    their micro-batch sizes, written beside ``out``; {(model, seq_len): profile path}."""
    from ..models import resolve_model
    from ..planner.profile import run_profile

    want: dict[tuple[str, int], tuple[set, set]] = {}
    for c in configs:
        tps, sizes = want.setdefault((c.model, c.seq_len), (set(), set()))
        tps.add(c.tp)
        sizes.add(c.mbs)
    paths = {}
    for (model, seq), (tps, sizes) in want.items():
        shape = shape_of(resolve_model(model, dtype="float32")[0], seq, 1)
        data = run_profile(shape, sorted(tps), sorted(sizes), device, gpu, log=lambda s: log(f"profile {model} s={seq} {s}"))
        if data["dtype"] != dtype:
            raise ValueError(f"the profile ran in {data['dtype']}, the trainer in {dtype}")
        paths[model, seq] = f"{out}_profile_{model.replace('/', '_')}_s{seq}.json"
        with open(paths[model, seq], "w") as f:
            json.dump(data, f, indent=1)
    return paths


def run(configs: list[Config], gpu: str, device: str, dtype: str, profile: str | None, warmup: int, steps: int,
        log=print, out: str | None = None) -> dict:
    """Measure and predict every configuration. ``profile``: a ``plan profile`` file, ``auto`` (profile
    this device first, one file per model and sequence length, beside ``out``), or None (the roofline).
    With a profile each row also carries the roofline's prediction."""
    profiles = profile_layers(configs, gpu, device, dtype, out or "plan_accuracy", log) if profile == "auto" else {}
    rows = []
    for cfg in configs:
        got = measure(cfg, device, dtype, warmup, steps)
        prof = profiles.get((cfg.model, cfg.seq_len)) if profile == "auto" else profile
        rows.append(score(cfg, got["shape"], got, gpu, prof, log))
    return {"gpu": gpu, "device": device, "dtype": dtype, "profile": profile, "rows": rows,
            "summary": summarize(rows, matmul_tflops(device, dtype))}


def score(cfg: Config, model_cfg, got: dict, gpu: str, prof: str | None, log=print) -> dict:
    """One result row: the measurement ``got`` (time_s, peak_bytes, tflops_per_gpu) against the
    planner's prediction from the profile ``prof`` (and the roofline's, when a profile is used)."""
    shape = shape_of(model_cfg, cfg.seq_len, cfg.global_batch)
    pred_s, pred_mem = predict(shape, gpu, cfg, prof)
    row = {"config": cfg.label, "model": cfg.model, "mbs": cfg.mbs, "global_batch": cfg.global_batch,
           "seq_len": cfg.seq_len, "recompute": cfg.recompute, "tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp,
           "v": cfg.v, "zero1": cfg.zero1, "measured_s": got["time_s"], "predicted_s": pred_s,
           "time_error": pred_s / got["time_s"] - 1, "measured_bytes": got["peak_bytes"],
           "predicted_bytes": pred_mem, "memory_error": pred_mem / got["peak_bytes"] - 1,
           "tflops_per_gpu": got["tflops_per_gpu"], "profile": prof}
    if prof:
        row["roofline_s"], row["roofline_bytes"] = predict(shape, gpu, cfg, None)
    log(f"{cfg.label:40s} measured {row['measured_s']:.4f} s predicted {pred_s:.4f} s "
        f"({row['time_error']:+.1%}); memory {row['measured_bytes'] / 2**30:.2f} GiB predicted "
        f"{pred_mem / 2**30:.2f} GiB ({row['memory_error']:+.1%}); {row['tflops_per_gpu']:.1f} TFLOP/s")
    return row


def summarize(rows: list[dict], rate: float) -> dict:
    best = max(rows, key=lambda r: r["tflops_per_gpu"])
    return {"configs": len(rows), "time_mean_abs_error": statistics.fmean(abs(r["time_error"]) for r in rows),
            "time_worst_abs_error": max(abs(r["time_error"]) for r in rows),
            "memory_mean_abs_error": statistics.fmean(abs(r["memory_error"]) for r in rows),
            "spearman": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
            "best": best["config"], "best_tflops_per_gpu": best["tflops_per_gpu"],
            "matmul_tflops": rate, "best_fraction_of_matmul": best["tflops_per_gpu"] / rate}


def rescore(result: dict, profiles: str | None, log=print) -> dict:
    """A stored result's measurements predicted again by the planner as it is now (no device needed),
    each row from its own profile file, looked up by name in the directory ``profiles``."""
    import os

    from ..models import resolve_model

    rows = []
    for r in result["rows"]:
        layout = ",".join(f"{k}={r[k]}" for k in ("tp", "pp", "dp", "v")) + ",zero1" * bool(r["zero1"])
        cfg = Config.parse(f"{r['model']}:{r['mbs']}:{r['global_batch']}:{r['seq_len']}" + ":full" * r["recompute"]
                           + "@" + layout)
        prof = r.get("profile")
        if prof and profiles:
            prof = os.path.join(profiles, os.path.basename(prof))
        got = {"time_s": r["measured_s"], "peak_bytes": r["measured_bytes"], "tflops_per_gpu": r["tflops_per_gpu"]}
        rows.append(score(cfg, resolve_model(cfg.model, dtype="float32")[0], got, result["gpu"], prof, log))
    return {**result, "rows": rows, "summary": summarize(rows, result["summary"]["matmul_tflops"]), "rescored": True}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 6), dpi=110)
    x, y = [r["measured_s"] for r in rows], [r["predicted_s"] for r in rows]
    ax.scatter(x, y, c="C0")
    for r in rows:
        ax.annotate(r["config"], (r["measured_s"], r["predicted_s"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    lo, hi = min(x + y) * 0.8, max(x + y) * 1.2
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.85", label="±10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured iteration time (s)")
    ax.set_ylabel("predicted iteration time (s)")
    s = result["summary"]
    ax.set_title(f"plan estimate vs measured on {result['gpu']}: MAE {s['time_mean_abs_error']:.1%}, "
                 f"rank corr {s['spearman']:.2f}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_bench_parser(bsub) -> None:
    p = bsub.add_parser("plan-accuracy", help="training layouts measured here against plan estimate",
                        description=__doc__.splitlines()[0])
    p.add_argument("--config", action="append", default=None, metavar=FORMAT,
                   help="a configuration (repeat it; default: ten GPT-shaped ones, 125M to 1.5B, one GPU each); "
                        "a layout of several ranks runs on as many local devices")
    p.add_argument("--gpu", default=None, help="the planner's GPU type of this device (default: detected)")
    p.add_argument("--profile", default=None,
                   help="a 'plan profile' JSON of this GPU, 'auto' (profile the trainer's layer here first, for every "
                        "model and sequence length), or 'roofline' (no profile); default: auto on a GPU, else roofline")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"), help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="bench/results/plan_accuracy", help="writes OUT.json and OUT.png")
    p.add_argument("--rescore", metavar="RESULT.json", default=None,
                   help="predict a stored result's measurements again with the planner as it is now (no device)")
    p.add_argument("--profiles", metavar="DIR", default=None, help="with --rescore: the directory of its profiles")
    p.set_defaults(func=cmd)


def cmd(args) -> int:
    from pathlib import Path

    if args.rescore:
        try:
            result = rescore(json.loads(Path(args.rescore).read_text()), args.profiles)
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            print(f"error: {args.rescore} is not a readable plan-accuracy result ({type(e).__name__}: {e})",
                  file=sys.stderr)
            return 2
        except ValueError as e:  # a profile it names is missing or of another shape
            print(f"error: {e}" + ("" if args.profiles else "; pass the directory of its profiles with --profiles"),
                  file=sys.stderr)
            return 2
        return _write(result, args.out)
    try:
        configs = [Config.parse(c) for c in (args.config or DEFAULT_CONFIGS)]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gpu = args.gpu
    if gpu is None:
        import torch

        from ..planner.profile import planner_gpu_name

        if not args.device.startswith("cuda"):
            print("error: name the planner's GPU type to predict with --gpu on a CPU", file=sys.stderr)
            return 2
        props = torch.cuda.get_device_properties(torch.device(args.device))
        gpu = planner_gpu_name(props.name, props.total_memory)
    if args.device.startswith("cuda"):
        import torch

        have = torch.cuda.device_count()
        if too_big := [c.label for c in configs if c.world > have]:
            print(f"error: {'; '.join(too_big)}: more ranks than the {have} GPU(s) here", file=sys.stderr)
            return 2
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    profile = args.profile or ("auto" if args.device.startswith("cuda") else "roofline")
    if profile not in ("auto", "roofline"):  # read it now, not after the measurements it would waste
        from ..planner.measured import load_profile

        try:
            load_profile(profile, gpu)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    result = run(configs, gpu, args.device, dtype, None if profile == "roofline" else profile, args.warmup, args.steps,
                 out=args.out)
    return _write(result, args.out)


def _write(result: dict, out: str) -> int:
    from pathlib import Path

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out + ".png")
    s = result["summary"]
    print(f"{s['configs']} configurations: time error {s['time_mean_abs_error']:.1%} mean, {s['time_worst_abs_error']:.1%} "
          f"worst; memory error {s['memory_mean_abs_error']:.1%} mean; rank correlation {s['spearman']:.2f}; best "
          f"{s['best']} at {s['best_tflops_per_gpu']:.1f} TFLOP/s = {s['best_fraction_of_matmul']:.0%} of the measured "
          f"{s['matmul_tflops']:.0f} TFLOP/s matrix rate; wrote {out}.json, {out}.png")
    return 0
