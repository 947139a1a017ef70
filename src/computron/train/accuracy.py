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
this device's measured matrix rate; per GPU count too), and a PNG of predicted against measured.
The same run asks the planner's search for its layout of every group of configurations that train
the same thing on as many GPUs and measures it against the group's fastest (``pick.py``), and
measures all-reduce and send/recv bandwidth between the ranks beside the planner's assumption
(``links.py``) and what each tensor-parallel all-reduce costs the trainer's layer over 2 (and 4)
ranks (``tpcoll.py``), which the predictions of that run then use.

Where a row's profile has ``step_s`` (each layer's forward and backward timed back to back, as a
step issues them: ``planner/profile.py measure``; profiles made since it was measured), the row also
carries ``paired_s`` and ``paired_error``: the same prediction with ``Assumptions.paired_steps`` on
(that time split between the forward and backward ops in place of their separate timings), and the
summary ``paired_time_mean_abs_error``, ``paired_time_worst_abs_error`` and ``paired_spearman`` where
every row has it. ``predicted_s``, the picks and everything else stay on the default (off), so one run
compares both; ``--rescore`` of a result whose profiles lack ``step_s`` gives what it gave before.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, replace

# GPT-shaped models from 125M to 1.3B, micro-batch, global batch, recomputation and sequence varied
DEFAULT_CONFIGS = ["gpt2:4:32:1024", "gpt2:8:32:1024", "gpt2:8:32:1024:full", "gpt2:16:64:512",
                   "gpt2-medium:4:32:1024", "gpt2-medium:8:32:1024:full", "gpt2-large:4:16:1024",
                   "gpt2-large:8:32:512:full", "gpt2-xl:2:16:1024", "gpt2-xl:4:16:1024:full"]


FORMAT = "MODEL:MBS:GLOBAL_BATCH:SEQ_LEN[:full][@tp=T,pp=P,dp=D,v=V,zero1,part=N/N/...]"
LAYOUT_FIELDS = ("model", "mbs", "global_batch", "seq_len", "recompute", "tp", "pp", "dp", "v", "zero1", "partition")


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
    partition: tuple[int, ...] | None = None  # layers per model chunk (pp * v, in model order); None: uniform

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
            elif key == "part" and all(x.isdigit() and int(x) >= 1 for x in value.split("/")):
                kw["partition"] = tuple(int(x) for x in value.split("/"))
            else:
                raise ValueError(f"configuration {text!r}: {item!r} is not tp=, pp=, dp=, v= (a positive integer), "
                                 f"zero1 or part= (positive layer counts joined by /); expected {FORMAT}")
        cfg = cls(parts[0], int(parts[1]), int(parts[2]), int(parts[3]), len(parts) == 5, **kw)
        if cfg.partition is not None and len(cfg.partition) != cfg.pp * cfg.v:
            raise ValueError(f"configuration {text!r}: part= needs pp*v = {cfg.pp * cfg.v} layer counts, "
                             f"got {len(cfg.partition)}")
        return cfg

    @classmethod
    def from_row(cls, row: dict) -> "Config":
        """The configuration of a result row (or any dict with ``LAYOUT_FIELDS``)."""
        part = row.get("partition")
        return cls(**{k: row[k] for k in LAYOUT_FIELDS if k != "partition"},
                   partition=None if part is None else tuple(part))

    def as_row(self) -> dict:
        d = {k: getattr(self, k) for k in LAYOUT_FIELDS}
        d["partition"] = None if self.partition is None else list(self.partition)
        return d

    def canonical(self, layers: int) -> "Config":
        """The same configuration with an explicit partition that is the uniform one written as None;
        ValueError when the partition does not cover ``layers``."""
        from ..parallel.sharding import stage_layers

        if self.partition is None:
            return self
        if sum(self.partition) != layers:
            raise ValueError(f"{self.label}: the partition covers {sum(self.partition)} layers, {self.model} has {layers}")
        uniform = tuple(len(r) for r in stage_layers(layers, self.pp * self.v))
        return replace(self, partition=None) if self.partition == uniform else self

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def label(self) -> str:
        layout = "" if self.world == 1 else f" tp{self.tp} pp{self.pp} dp{self.dp}" + f" v{self.v}" * (self.v > 1) + \
            " zero1" * self.zero1
        part = "" if self.partition is None else " part" + "/".join(map(str, self.partition))
        return f"{self.model} mbs={self.mbs} gb={self.global_batch} s={self.seq_len}" + " rc" * self.recompute + layout + part


def shape_of(c, seq_len: int, global_batch: int):
    """The planner's shape of an engine ``ModelConfig`` as this trainer runs it (fused attention, no
    dropout), with the model's activation and norm placement, so that ``plan profile`` measures the
    trainer's layer (OPT: ReLU, not the gpt family's GeLU)."""
    from ..planner.model import TransformerShape

    return TransformerShape(c.name, "llama" if c.family == "llama" else "gpt", c.num_layers, c.hidden_size,
                            c.num_heads, c.ffn_size, c.vocab_size, seq_len, global_batch, kv_heads=c.kv_heads,
                            dtype="bfloat16", tie_embeddings=c.tie_embeddings, flash_attention=True, dropout=False,
                            activation=c.activation, pre_norm=c.pre_norm)


FITTED_TP_COLLECTIVE_S = 220e-6  # the fallback when a run measured no tp collective (assumptions)


def assumptions(measured: dict[int, float] | None = None, keeps_outputs: bool | None = None,
                graphed: dict[int, float] | None = None, graphs: bool = False):
    """The cost model's assumptions for this trainer: bf16 weight copies, float32 gradients, masters
    and AdamW moments, 18 bytes a parameter; and its own host-bound step:

    - with ``graphs`` (``--cuda-graphs``), ``graphed_steps``: every layout replays each micro-batch as
      CUDA graphs (a pipeline stage by stage), its layers at the profile's ``graph_s`` and each
      tensor-parallel all-reduce at its ring time plus ``graphed`` ({tp: seconds}, ``tpcoll.py``'s
      graphed measurement of this run) for each tp it holds, else the ring alone;
    - the tensor-parallel per-collective cost: ``measured`` ({tp: seconds}, ``tpcoll.py``, this run's
      own) for each tp it holds; for any other, ``tp_collective_s`` 220 us, fitted on the two-GPU H200
      run alone (bench/results/plan_accuracy_h200_x4_two.json; the four-GPU run held out,
      docs/training.md): each all-reduce (4 a layer, eager ``_SumBothWays`` autograd calls) costs its
      host's issue and the wait for the other ranks' hosts beyond the ring time; the profile times a
      layer's shard in one process, without either;
    - ``chunk_overhead_s`` 0: torch.distributed.pipelining posts its sends and receives as NCCL work
      on the stream and does not synchronise the host after them, so no chunk op idles the GPU the
      way Megatron's blocking batched p2p does (the 1.5 ms default is fitted on Megatron runs);
    - its memory, read off ``job.py`` (no constant fitted): ZeRO-1 is torch's ZeroRedundancyOptimizer
      over the fp32 masters, which shards the AdamW moments only; where the pipeline schedule keeps
      the outputs (``keeps_outputs``; default: as ``job.pipeline_keeps_outputs`` says of this torch,
      True for the runs made before the trainer turned ``return_outputs`` off), the last stage keeps
      every micro-batch's logits and concatenates them at the step's end; the gradients are freed between steps, each micro-batch
      without a pipeline takes its whole bf16 gradient from ``autograd.grad``, and the data-parallel
      all-reduce goes through one flat copy of all gradients (``planner/estimate.py stage_memory``);
      its Llama layer is plain torch ops (``models/transformer.py``): the unfused SwiGLU keeps the SiLU
      output, RoPE's rotated Q and K are kept beside the whole QKV output, and each RMSNorm keeps its
      1/rms (``unfused_llama``, ``planner/costs.py activation_bytes``).
    """
    from ..planner.costs import Assumptions
    from .job import pipeline_keeps_outputs

    return Assumptions(bytes_per_param=18, tp_collective_s=FITTED_TP_COLLECTIVE_S, chunk_overhead_s=0.0,
                       tp_collective_by_tp=tuple(sorted((measured or {}).items())), zero_shards_master=False,
                       keep_pipeline_outputs=pipeline_keeps_outputs() if keeps_outputs is None else keeps_outputs,
                       step_transients=True, unfused_llama=True, graphed_steps=graphs,
                       tp_collective_graphed_by_tp=tuple(sorted((graphed or {}).items())))


def tp_collective_used(groups: list[dict]) -> dict:
    """The result's ``tp_collective``: the measurements ``groups`` (``tpcoll.run``; none when the run
    measured nothing, or a stored result predates them), the value each tp size took from them, the
    fallback, and which of the two the predictions used."""
    from .tpcoll import by_tp

    got, graphed = by_tp(groups), by_tp(groups, graphed=True)
    return {"used": "measured" if got else "fitted", "measured_by_tp": {str(t): s for t, s in sorted(got.items())},
            "graphed_by_tp": {str(t): s for t, s in sorted(graphed.items())},
            "fallback_s": FITTED_TP_COLLECTIVE_S, "groups": groups}


def cost_model(shape, gpu: str, profile: str | None, a=None):
    """The planner's cost model of ``shape`` for this trainer under assumptions ``a`` (default:
    :func:`assumptions`), from the profile ``profile`` (a file) or the roofline."""
    from ..planner.estimate import CostModel
    from ..planner.measured import load_profile

    return CostModel(shape, a or assumptions(), load_profile(profile, gpu) if profile else None)


def predict(shape, gpu: str, cfg: Config, profile: str | None, a=None) -> tuple[float, float]:
    """(iteration seconds, peak bytes) the planner gives for one GPU of type ``gpu`` under assumptions
    ``a`` (default: :func:`assumptions`)."""
    r = planned(shape, gpu, cfg, profile, a)
    return r.iteration_s, max(r.stage_memory)


def planned(shape, gpu: str, cfg: Config, profile: str | None, a=None):
    """The planner's result for ``cfg`` (:func:`predict`'s figures, each stage's memory among them)."""
    from ..parallel.dims import ParallelDims
    from ..parallel.sharding import stage_layers
    from ..planner.estimate import PlanConfig, PlanContext
    from ..planner.hardware import load_cluster
    from ..planner.layout import stage_envs

    cm = cost_model(shape, gpu, profile, a)
    dims = ParallelDims(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp)
    placement = (load_cluster(f"{gpu}:{cfg.world}x1").node_types[0],)
    ctx = PlanContext(cm, stage_envs(placement, dims, cm.a),
                      PlanConfig(dims, cfg.mbs, cfg.v, cfg.recompute, cfg.zero1, False, False, False))
    # the trainer's partition (uniform unless given); chunk c on stage c % pp
    chunks = stage_layers(shape.layers, cfg.pp * cfg.v, cfg.partition)
    counts = [sum(len(chunks[c]) for c in range(s, cfg.pp * cfg.v, cfg.pp)) for s in range(cfg.pp)]
    return ctx.result(ctx.check_counts(counts), "given", placement)


def measure(cfg: Config, device: str, dtype: str, warmup: int, steps: int, graphs: bool = False) -> dict:
    """Median step time, peak bytes (the largest rank's) and model TFLOP/s per GPU of ``cfg``; a
    layout of several ranks runs as that many processes here (``dist.spawn``), rank 0 reporting."""
    from ..models import resolve_model

    if cfg.world == 1:
        out = _measure_here(cfg, device, dtype, warmup, steps, graphs)
    else:
        import tempfile

        from .dist import spawn

        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/rank0.json"
            spawn(cfg.world, _measure_rank, cfg, device, dtype, warmup, steps, path, graphs)
            with open(path) as f:
                out = json.load(f)
    out["shape"] = resolve_model(cfg.model, dtype="float32")[0]
    return out


def _measure_here(cfg: Config, device: str, dtype: str, warmup: int, steps: int, graphs: bool = False) -> dict:
    from .config import TrainConfig
    from .job import Trainer

    tr = Trainer(TrainConfig(model=cfg.model, seq_len=cfg.seq_len, global_batch=cfg.global_batch, micro_batch=cfg.mbs,
                             steps=warmup + steps, recompute=cfg.recompute, device=device, dtype=dtype,
                             dims={"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp}, virtual_stages=cfg.v, zero1=cfg.zero1,
                             partition=None if cfg.partition is None else list(cfg.partition),
                             cuda_graphs=graphs,
                             synthetic_tokens=(cfg.global_batch * (warmup + steps) + 1) * cfg.seq_len + 1))
    recs = [tr.train_step() for _ in range(warmup + steps)][warmup:]
    by_rank = [max(ranks) for ranks in zip(*(r["peak_bytes"] for r in recs))]
    out = {"time_s": statistics.median(r["time_s"] for r in recs), "peak_bytes": max(by_rank),
           "tflops_per_gpu": statistics.median(r["tflops_per_gpu"] for r in recs),
           "peak_bytes_by_rank": by_rank, "graph_bytes_by_rank": recs[-1]["graph_bytes"]}
    tr.close()  # its graphs go before the process group does
    del tr, recs
    _release()  # else the next configuration's peak would count this one's memory
    return out


def _measure_rank(cfg: Config, device: str, dtype: str, warmup: int, steps: int, path: str,
                  graphs: bool = False) -> int:
    """One rank of a layout's measurement (``dist.spawn`` sets its environment)."""
    import os

    from . import dist

    device = dist.local_device(device)
    dist.init(device, 300.0)
    out = _measure_here(cfg, device, dtype, warmup, steps, graphs)
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


def profile_layers(configs: list[Config], gpu: str, device: str, dtype: str, out: str, log=print,
                   search_tps: bool = False) -> dict:
    """``plan profile`` of this device for every (model, sequence length, tp) the configurations use, at
    their micro-batch sizes, written beside ``out``; {(model, seq_len): profile path}. ``search_tps``:
    also every tp the planner's pick may take on the configurations' GPU counts (``pick.trainer_tps``)
    and every micro-batch size under the smallest configured that divides a configured global batch,
    so that the search compares measured layers with measured layers (a size outside the measured
    ones is only scaled from the nearest, ``CostModel.layer``; on two H200s picks of micro-batch 1
    scaled in proportion from 2 or 4 ran 1.3-1.7x slower than predicted)."""
    from ..models import resolve_model
    from ..planner.profile import run_profile
    from .pick import trainer_tps

    want: dict[tuple[str, int], tuple[set, set]] = {}
    for c in configs:
        tps, sizes = want.setdefault((c.model, c.seq_len), (set(), set()))
        tps.add(c.tp)
        sizes.add(c.mbs)
        if search_tps:
            tps.update(trainer_tps(shape_of(resolve_model(c.model, dtype="float32")[0], c.seq_len, 1), c.world))
    if search_tps:
        for (model, seq), (_, sizes) in want.items():
            batches = {c.global_batch for c in configs if (c.model, c.seq_len) == (model, seq)}
            sizes.update(b for b in range(1, min(sizes)) if any(g % b == 0 for g in batches))
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
        log=print, out: str | None = None, pick: bool = True, links: bool = True, link_sizes=None,
        graphs: bool = False, tp_collective: bool = True) -> dict:
    """Measure and predict every configuration. ``profile``: a ``plan profile`` file, ``auto`` (profile
    this device first, one file per model and sequence length, beside ``out``), or None (the roofline).
    With a profile each row also carries the roofline's prediction. ``pick``: the planner's search picks
    a layout for every group of configurations that train the same thing on as many GPUs; a pick no
    configuration runs is measured too (its row marked ``added``; a pick that fails to run is reported,
    not raised) and ``pick`` in the result compares each pick with its group's fastest (``pick.py``).
    ``links``: all-reduce and send/recv measured over every number of ranks (> 1) the configurations
    use, beside the bandwidths the planner assumes (``links.py``; ``link_sizes`` in bytes). ``graphs``:
    every layout trains with CUDA graphs (``computron train --cuda-graphs``); each row says whether
    it did. ``tp_collective``: the per-collective cost of tensor parallelism measured
    first over every tp size the configurations (and the search) use (``tpcoll.py``); every
    prediction and the search take it, the fitted constant for a size not measured; the result's
    ``tp_collective`` says which (:func:`tp_collective_used`)."""
    from ..models import resolve_model
    from . import links as comm
    from . import pick as picking
    from . import tpcoll

    models = {c.model: resolve_model(c.model, dtype="float32")[0] for c in configs}
    configs = [c.canonical(models[c.model].num_layers) for c in configs]
    profiles = profile_layers(configs, gpu, device, dtype, out or "plan_accuracy", log, pick) if profile == "auto" else {}

    def profile_of(model: str, seq_len: int) -> str | None:
        return profiles.get((model, seq_len)) if profile == "auto" else profile

    measured_links = [comm.run(n, gpu, device, assumptions(), link_sizes, log)
                      for n in sorted({c.world for c in configs} - {1})] if links else []
    tp = tp_collective_used(tpcoll.run(configs, models, gpu, device, dtype, assumptions(), pick, log)
                            if tp_collective else [])
    a = assumptions(tpcoll.by_tp(tp["groups"]), graphed=tpcoll.by_tp(tp["groups"], graphed=True), graphs=graphs)
    picks = picking.search_picks(configs, models, gpu, profile_of, log, a) if pick else {}
    added = picking.to_measure(configs, picks)
    rows, failed = [], {}
    for cfg in configs + added:
        try:
            got = measure(cfg, device, dtype, warmup, steps, graphs)
        except (RuntimeError, ValueError) as e:  # a rank failed (RankFailed), out of memory, or refused
            # recorded, and the rest still measured: one layout the runtime cannot run must not lose a
            # dozen measurements (the command exits non-zero, naming it)
            failed[cfg.label] = f"{'the pick ' if cfg in added else ''}failed to run: {e}"
        if cfg.label in failed:  # past the handler, so that the failed trainer's frames can be freed
            log(f"{cfg.label}: {failed[cfg.label]}")
            _release()
            continue
        rows.append(score(cfg, got["shape"], got, gpu, profile_of(cfg.model, cfg.seq_len), log, a))
        rows[-1]["cuda_graphs"] = graphs
        if cfg in added:
            rows[-1]["added"] = "pick"
    if not rows:
        raise RuntimeError("no configuration ran: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    result = {"gpu": gpu, "device": device, "dtype": dtype, "profile": profile, "rows": rows,
              "summary": summarize(rows, matmul_tflops(device, dtype)), "failed": failed, "tp_collective": tp,
              "pipeline_keeps_outputs": a.keep_pipeline_outputs}
    if pick:
        picked = {label for label in failed if label in {c.label for c in added}}
        result["pick"] = {**picking.compare(rows, picks, failed), "failed": {k: failed[k] for k in picked}}
    if links:
        result["links"] = measured_links
    return result


def _release() -> None:
    """Free what a configuration left behind (the trainer's cycles hold GPU memory until collected)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def score(cfg: Config, model_cfg, got: dict, gpu: str, prof: str | None, log=print, a=None) -> dict:
    """One result row: the measurement ``got`` (time_s, peak_bytes, tflops_per_gpu) against the
    planner's prediction under assumptions ``a`` (default: :func:`assumptions`) from the profile
    ``prof`` (and the roofline's, when a profile is used); a tp layout's row also says which
    per-collective cost it was predicted with."""
    a = a or assumptions()
    shape = shape_of(model_cfg, cfg.seq_len, cfg.global_batch)
    plan = planned(shape, gpu, cfg, prof, a)
    pred_s, pred_mem = plan.iteration_s, max(plan.stage_memory)
    row = {"config": cfg.label, **cfg.as_row(), "measured_s": got["time_s"], "predicted_s": pred_s,
           "time_error": pred_s / got["time_s"] - 1, "measured_bytes": got["peak_bytes"],
           "predicted_bytes": pred_mem, "memory_error": pred_mem / got["peak_bytes"] - 1,
           "tflops_per_gpu": got["tflops_per_gpu"], "profile": prof}
    for key in ("peak_bytes_by_rank", "graph_bytes_by_rank"):  # the ranks' peaks and their graphs' pools
        if key in got:
            row[key] = got[key]
    if cfg.pp > 1:  # each stage's memory: predicted, and measured as its ranks' largest peak (rank // (dp*tp))
        row["predicted_bytes_by_stage"] = list(plan.stage_memory)
        if "peak_bytes_by_rank" in got:
            per = cfg.dp * cfg.tp
            row["measured_bytes_by_stage"] = [max(got["peak_bytes_by_rank"][s * per:(s + 1) * per])
                                              for s in range(cfg.pp)]
    paired = ""
    if prof and has_steps(prof, gpu):  # the same with each layer's forward and backward as a step issues them
        row["paired_s"] = predict(shape, gpu, cfg, prof, replace(a, paired_steps=True))[0]
        row["paired_error"] = row["paired_s"] / got["time_s"] - 1
        paired = f", paired {row['paired_s']:.4f} s ({row['paired_error']:+.1%})"
    if cfg.tp > 1:
        used = a.graph_view() if a.graphed_steps else a
        row["tp_collective_s"] = used.tp_collective_at(cfg.tp)
        row["tp_collective_source"] = "measured" if cfg.tp in dict(used.tp_collective_by_tp) else "fitted"
    if prof:
        row["roofline_s"], row["roofline_bytes"] = predict(shape, gpu, cfg, None, a)
    log(f"{cfg.label:40s} measured {row['measured_s']:.4f} s predicted {pred_s:.4f} s "
        f"({row['time_error']:+.1%}{paired}); memory {row['measured_bytes'] / 2**30:.2f} GiB predicted "
        f"{pred_mem / 2**30:.2f} GiB ({row['memory_error']:+.1%}); {row['tflops_per_gpu']:.1f} TFLOP/s")
    return row


def has_steps(prof: str, gpu: str) -> bool:
    """Whether the profile file ``prof`` has any ``step_s`` (what ``Assumptions.paired_steps`` uses)."""
    from ..planner.measured import load_profile

    return bool(load_profile(prof, gpu).steps)


def summarize(rows: list[dict], rate: float) -> dict:
    """The errors, rank correlation and best throughput of ``rows`` (and of their ``paired_s`` where
    every row has one); with several GPU counts, the same for each count under ``by_gpus``."""
    best = max(rows, key=lambda r: r["tflops_per_gpu"])
    out = {"configs": len(rows), "time_mean_abs_error": statistics.fmean(abs(r["time_error"]) for r in rows),
           "time_worst_abs_error": max(abs(r["time_error"]) for r in rows),
           "memory_mean_abs_error": statistics.fmean(abs(r["memory_error"]) for r in rows),
           "spearman": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
           "best": best["config"], "best_tflops_per_gpu": best["tflops_per_gpu"],
           "matmul_tflops": rate, "best_fraction_of_matmul": best["tflops_per_gpu"] / rate}
    if all("paired_s" in r for r in rows):
        out.update(paired_time_mean_abs_error=statistics.fmean(abs(r["paired_error"]) for r in rows),
                   paired_time_worst_abs_error=max(abs(r["paired_error"]) for r in rows),
                   paired_spearman=spearman([r["paired_s"] for r in rows], [r["measured_s"] for r in rows]))
    gpus = sorted({r["tp"] * r["pp"] * r["dp"] for r in rows})
    if len(gpus) > 1:
        out["by_gpus"] = {str(n): summarize([r for r in rows if r["tp"] * r["pp"] * r["dp"] == n], rate) for n in gpus}
    return out


def rescore(result: dict, profiles: str | None, log=print) -> dict:
    """A stored result's measurements predicted again by the planner as it is now (no device needed),
    each row from its own profile file, looked up by name in the directory ``profiles``; its picks
    searched again (a pick the stored run did not measure is said to be so), its links' assumed
    bandwidths read again, and its tensor-parallel per-collective cost derived again from its
    measurement (a result without one takes the fitted constant, as when it was made)."""
    import os

    from ..models import resolve_model
    from . import links as comm
    from . import pick as picking
    from . import tpcoll

    groups = [g if "error" in g else tpcoll.derive(g, result["gpu"], assumptions())
              for g in result.get("tp_collective", {}).get("groups", [])]
    tp = tp_collective_used(groups)
    keeps = result.get("pipeline_keeps_outputs", True)  # the trainer kept them before it recorded so
    a = assumptions(tpcoll.by_tp(groups), keeps, tpcoll.by_tp(groups, graphed=True),
                    graphs=any(r.get("cuda_graphs") for r in result["rows"]))
    rows, where = [], {}
    for r in result["rows"]:
        cfg = Config.from_row(r)
        prof = r.get("profile")
        if prof and profiles:
            prof = os.path.join(profiles, os.path.basename(prof))
        where[cfg.model, cfg.seq_len] = prof
        got = {"time_s": r["measured_s"], "peak_bytes": r["measured_bytes"], "tflops_per_gpu": r["tflops_per_gpu"],
               **{k: r[k] for k in ("peak_bytes_by_rank", "graph_bytes_by_rank") if k in r}}
        ran = a if r.get("cuda_graphs") else replace(a, graphed_steps=False)  # each row as it ran
        rows.append(score(cfg, resolve_model(cfg.model, dtype="float32")[0], got, result["gpu"], prof, log, ran))
        rows[-1]["cuda_graphs"] = r.get("cuda_graphs", False)
        if r.get("added"):
            rows[-1]["added"] = r["added"]
    out = {**result, "rows": rows, "summary": summarize(rows, result["summary"]["matmul_tflops"]), "rescored": True,
           "tp_collective": tp, "pipeline_keeps_outputs": keeps}
    if "pick" in result:
        configs = [Config.from_row(r) for r in rows]
        models = {c.model: resolve_model(c.model, dtype="float32")[0] for c in configs}
        picks = picking.search_picks(configs, models, result["gpu"], lambda m, s: where.get((m, s)), log, a)
        failed = result["pick"].get("failed", {})
        out["pick"] = {**picking.compare(rows, picks, failed), "failed": failed}
    if "links" in result:
        a = assumptions()
        out["links"] = [g if "error" in g else comm.compare(g, comm.assumed(result["gpu"], g["ranks"], a), a)
                        for g in result["links"]]
    return out
