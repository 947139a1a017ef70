"""The built-in training job: a decoder of this project on token data, AdamW, gradient accumulation.

What flows through: each step takes a fixed global batch of samples (``data.py``), split into
micro-batches whose size may change from one micro-batch to the next (colocation picks it, see
``colocate/client.py``). A micro-batch's loss is its summed token cross-entropy divided by the
global batch's token count, and its gradients (``autograd.grad``, so an abandoned micro-batch
leaves nothing behind) are added into the accumulators; so the update is the same whatever the
split. Master weights, gradients and AdamW moments are float32 on the job's device (CPU or GPU).
With ``--dtype bfloat16`` (GPU) the model computes with bf16 copies of the weights, refreshed once per
step after the update (not once per micro-batch, as autocast would cast them), and each micro-batch's
bf16 gradients are added into the float32 accumulators: 18 bytes per parameter, as the planner's
``bytes_per_param=18``. AdamW runs fused on the GPU.

Parallelism (``dist.py`` for the process layout): one process per rank. Data parallelism gives
each replica its slice of ``step_samples`` (the same global batch, so the loss scaling holds) and
all-reduces the gradients once per step in ``_sync_grads`` (one flat buffer; after the last
micro-batch, so accumulation needs no hook); ``zero1`` shards AdamW's state over the replicas
(torch's ``ZeroRedundancyOptimizer``). Tensor and pipeline parallelism use the inference sharding
plan (``parallel/sharding.py``, ``build_rank``): each rank builds only its shard of the same
weights, with collectives that carry gradients (``parallel/collectives.py``); the gradients of the
replicated parameters are summed over the tensor group, a tied embedding's two copies over the
first and last stage. Pipeline stages run under ``torch.distributed.pipelining`` (1F1B, or
interleaved 1F1B with ``virtual_stages`` chunks per rank); the schedule splits a replica's batch
into equal micro-batches of ``micro_batch``, so colocation's changing micro-batch runs one process
only. ``recompute``: each layer's activations are recomputed in the backward.

Checkpoints (safetensors only): ``DIR/model`` is a servable checkpoint (config.json +
model.safetensors, ``save_checkpoint``), ``DIR/optimizer.safetensors`` the AdamW moments, and
``DIR/state.json`` the step and the job's config; ``resume`` continues from it bit for bit.
"""

from __future__ import annotations

import functools
import json
import resource
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..colocate.client import Colocation
from ..colocate.devpool import releaser
from ..colocate.memmodel import MemoryModel, estimate
from ..colocate.park import Parking, training_slots
from ..models import checkpoint as ckpt
from ..models import load_tokenizer, load_weights, resolve_model, save_checkpoint
from ..models.config import ModelConfig
from ..models.transformer import DecoderLM, DenseBatch, bind_weights, rope_tables
from ..parallel.collectives import install_tp_hooks
from ..parallel.dims import ParallelDims
from ..parallel.shard_model import build_rank
from ..parallel.sharding import Shard, uncut
from ..planner.profile import side_stream
from .config import TrainConfig
from .data import TokenData
from .dist import Mesh
from .stage_graphs import pool_bytes


def model_flops_per_sample(c: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one sample's forward and backward (3x forward, full s^2 attention, no
    recomputation), the planner's accounting (``planner/costs.py``)."""
    s, h, d = seq_len, c.hidden_size, c.head_dim
    mat = h * (c.num_heads + 2 * c.kv_heads) * d + c.num_heads * d * h + h * c.ffn_size * (3 if c.gated_mlp else 2)
    return 3.0 * (c.num_layers * (2.0 * s * mat + 4.0 * s * s * h) + 2.0 * s * h * c.vocab_size)


def recomputed(forward):
    """``forward`` under activation checkpointing, as ``recompute`` wraps each layer (and ``plan
    profile`` times the layer it measures for the planner, ``planner/profile.py``): torch's
    non-reentrant checkpoint, without stashing and restoring the RNG states (the layers draw no
    random numbers, no dropout, so there is nothing to replay; the stash is host work per layer)."""
    from torch.utils.checkpoint import checkpoint

    return functools.partial(checkpoint, forward, use_reentrant=False, preserve_rng_state=False)


# The head's product over a vocabulary padded to this many rows: GPT-2's 50,257 rows ran an sm75
# fallback GEMM on the H100, 62 of a step's 166 ms of GPU time (gpt2, micro-batch 8 x 1024 tokens).
HEAD_ALIGN = 128

# A colocated job's run-ahead fence at every this many watched points: fewer events and waits for the
# host; GPT-2-medium on an H200 stepped in 131/118 ms with 4 against 148/120 ms with 1 (run-ahead 8;
# 108 ms unbounded; bench/results/handover_h200_s41)
FENCE_EVERY = 4


class _Stage(nn.Module):
    """One model chunk as a step calls it: token ids ``[m, t]`` (first chunk) or hidden states
    ``[m, t, hidden]`` in; hidden states, or logits ``[m, t, vocab padded to HEAD_ALIGN]`` (last chunk,
    contiguous: a pipeline stage checks its outputs' strides; the loss slices the padding off), out."""

    def __init__(self, model: DecoderLM, dtype: torch.dtype):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model, (m, t) = self.model, x.shape[:2]
        positions = torch.arange(t, device=x.device).repeat(m)
        batch = DenseBatch(m)
        if model.cfg.position == "rope":
            batch.rope = rope_tables(model.cfg, positions, self.dtype)
        h = model.embed(x.reshape(-1), positions) if model.first else x.reshape(m * t, -1)
        for layer in model.layers:
            h = layer(h, batch)
        out = model.head(h, HEAD_ALIGN, trim=False) if model.last else h  # the loss trims the padding
        return out.view(m, t, -1)


class SoftmaxCrossEntropy(torch.autograd.Function):
    """Summed token cross-entropy of logits ``[N, width]`` (any float dtype), computed in float32 in
    place: one float32 copy of the logits becomes their softmax (kept for the backward) and then, in
    the backward, the gradient, returned in the logits' dtype. Peak (4 + e) bytes a logit where
    ``F.cross_entropy(logits.float())`` holds the copy, its log-softmax and two gradients (16 + e).
    The backward reuses the saved softmax, so it runs once (no ``retain_graph``).

    ``valid``: the columns that are vocabulary (the rest, padding of the head's product, get no
    probability and no gradient; default all). Vocabulary parallel (``group``, a tensor-parallel
    group): the columns are this rank's range of the vocabulary, ids ``start`` .. ``start + valid``;
    the row maxima and the softmax denominators are all-reduced over the group, and so is each target's
    logit, which one rank holds. Every rank gets the whole loss and the gradient of its own columns,
    which is all its shard of the head needs: no rank gathers the logits."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, valid: int | None = None, start: int = 0,
                group=None) -> torch.Tensor:
        valid = logits.shape[-1] if valid is None else valid
        x = torch.empty(logits.shape[0], valid, dtype=torch.float32, device=logits.device)
        x.copy_(logits[:, :valid])
        peak = x.amax(-1)
        if group is not None:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        x -= peak[:, None]
        local = targets - start
        mine = (local >= 0) & (local < valid)
        local = local.clamp(0, valid - 1)
        parts = torch.stack((x.gather(-1, local[:, None]).squeeze(-1) * mine, x.exp_().sum(-1)))
        if group is not None:  # each target's logit (one rank holds it) and the denominators
            dist.all_reduce(parts, group=group)
        picked, total = parts
        x /= total[:, None]
        ctx.save_for_backward(x, local, mine)
        ctx.dtype, ctx.width = logits.dtype, logits.shape[-1]
        return (total.log() - picked).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p, local, mine = ctx.saved_tensors
        p[torch.arange(len(local), device=p.device), local] -= mine.to(p.dtype)
        p.mul_(grad)
        if p.shape[-1] == ctx.width:
            return p.to(ctx.dtype), None, None, None, None
        out = torch.zeros(p.shape[0], ctx.width, dtype=ctx.dtype, device=p.device)  # the padding's: zero
        out[:, :p.shape[-1]] = p
        return out, None, None, None, None


def _all_reduce(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` over ``group`` in one collective (one flat buffer)."""
    flat = torch.cat([x.reshape(-1) for x in tensors])
    dist.all_reduce(flat, group=group)
    for x, y in zip(tensors, flat.split([x.numel() for x in tensors])):
        x.copy_(y.view_as(x))


def _gib(n: int | None) -> str:
    return "no limit" if n is None else f"{n / 2**30:.2f} GiB"


def _fold_grad(master: torch.Tensor, work: torch.Tensor) -> None:
    """Add ``work``'s gradient (bf16) into ``master``'s float32 one and drop it."""
    master.grad = work.grad.float() if master.grad is None else master.grad.add_(work.grad)
    work.grad = None


@functools.cache
def pipeline_keeps_outputs() -> bool:
    """Does a pipeline step keep every micro-batch's output on the last stage (and concatenate them
    at its end)? Not where ``torch.distributed.pipelining``'s ``step`` takes ``return_outputs`` (the
    trainer turns it off: only the losses are used); the planner's memory model asks
    (``Assumptions.keep_pipeline_outputs``, ``train/accuracy.py``)."""
    import inspect

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return "return_outputs" not in inspect.signature(PipelineScheduleSingle.step).parameters


def graphs_refused(device: str, colocate: bool = False) -> str | None:
    """Why a job of this layout cannot train with ``cuda_graphs`` (None: it can). Colocation resizes
    micro-batches at run time. Tensor parallelism's all-reduces are captured in the graphs; data
    parallelism's run after them, eager; a pipeline's transfers stay with its schedule, outside each
    stage's graphs (``train/stage_graphs.py``)."""
    if not device.startswith("cuda") or colocate:
        return ("cuda_graphs needs a CUDA device and no colocation: "
                f"got device {device}" + (", colocation" if colocate else ""))
    return None


class Trainer:
    def __init__(self, cfg: TrainConfig, log=None):
        self.cfg, self.log = cfg, log or (lambda s: None)
        self.dims = ParallelDims(**cfg.dims)
        self.device = torch.device(cfg.device)
        if cfg.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {cfg.dtype!r}")
        self.model_cfg, ckpt_dir = resolve_model(cfg.model, dtype="float32")
        self.micro_batches = self._check()
        self.mesh = Mesh.build(self.dims, cfg.timeout_s)
        self.compute_dtype = getattr(torch, cfg.dtype)
        self.params: dict[str, torch.Tensor] = {}  # global name -> float32 master weight (its .grad accumulates)
        self.work: list[torch.Tensor] = []  # the model's parameters in self.params' order (bf16 copies, or the masters)
        self.chunks = self._build(ckpt_dir)
        self.model = self.chunks[0][1]
        self._vocab = self.chunks[-1][0].vocab[:2]  # (start, stop) of the vocabulary the last chunk's head holds
        self.stages = [_Stage(m, self.compute_dtype) for _, m in self.chunks]
        self.opt = self._optimizer()
        self.data = (TokenData.from_text(cfg.data, load_tokenizer(ckpt_dir, self.model_cfg), cfg.seq_len, cfg.seed)
                     if cfg.data else
                     TokenData.synthetic(self.model_cfg.vocab_size, cfg.synthetic_tokens, cfg.seq_len, cfg.seed))
        self.flops_per_sample = model_flops_per_sample(self.model_cfg, cfg.seq_len)
        self.step_no = 0
        # cuda_graphs: a micro-batch size -> its graph, inputs, targets and loss; the float32 gradient
        # accumulators every graph adds into; the graphs' memory pool (made at the first step)
        self._graphs: dict[int, dict] = {}
        self._grad_acc: list[torch.Tensor] | None = None
        self._graph_pool = None
        self._graph_bytes = 0  # what the captures' private pool holds (peak memory counts it)
        self._graphed: list = []  # a graphed pipeline's stages (train/stage_graphs.py), made by _schedule
        self.schedule = self._schedule() if self.dims.pp > 1 else None  # graphed stages: their accumulators too
        self.samples_seen: list[list[int]] = []  # per step, the sample ids in the order they were used
        cuda = self.device.type == "cuda"
        self.parking = Parking(lambda: training_slots(self.params.values(), self.opt), self.device)
        self.colo = Colocation(cfg.colocate, cfg.colocate_device, self.memory_model(),
                               on_pause=self._pause, on_resume=self._resume,
                               release=releaser(self.device),
                               measure=(torch.cuda.reset_peak_memory_stats, torch.cuda.max_memory_allocated)
                               if cuda else None, run_ahead=cfg.colocate_run_ahead if cfg.colocate else 0,
                               fence_every=self._fence_every())
        self.colo.watch(self.model)
        if cfg.resume and cfg.checkpoint and (Path(cfg.checkpoint) / "state.json").is_file():
            self.load(cfg.checkpoint)

    def _fence_every(self) -> int:
        """The run-ahead's fence spacing: as asked, else 4 points, or the bound when smaller."""
        cfg = self.cfg
        if not cfg.colocate or not cfg.colocate_run_ahead:
            return 1
        every = cfg.colocate_fence_every
        return min(FENCE_EVERY, cfg.colocate_run_ahead) if every is None else every

    def _check(self) -> int:
        """Refuse what this layout cannot run, with the reason; the micro-batches of a replica's batch."""
        cfg, dims, c = self.cfg, self.dims, self.model_cfg
        dims.validate_for(num_layers=c.num_layers, num_heads=c.num_heads, num_kv_heads=c.kv_heads)
        if c.position == "learned" and cfg.seq_len > c.max_position:
            raise ValueError(f"seq_len {cfg.seq_len} exceeds the {c.max_position} positions {c.name} has learned")
        if dims.tp > c.kv_heads:
            raise ValueError(f"tp={dims.tp} exceeds the {c.kv_heads} key/value heads: training keeps one tensor "
                             "rank per key/value head")
        if dims.world_size > 1 and cfg.colocate:
            raise ValueError("colocation runs one process; it takes no dp, tp or pp")
        if cfg.cuda_graphs and (why := graphs_refused(cfg.device, cfg.colocate)):
            raise ValueError(why)
        if dims.world_size > 1 and cfg.checkpoint:
            raise ValueError("checkpoints are written by single-process jobs only (dp=tp=pp=1)")
        if cfg.global_batch % dims.dp:
            raise ValueError(f"dp={dims.dp} does not divide the global batch of {cfg.global_batch}")
        if cfg.virtual_stages < 1 or (cfg.virtual_stages > 1 and dims.pp == 1):
            raise ValueError(f"virtual_stages={cfg.virtual_stages} needs pp > 1 (interleaved 1F1B)")
        local = cfg.global_batch // dims.dp
        if dims.pp > 1 and local % cfg.micro_batch:
            raise ValueError(f"micro-batch {cfg.micro_batch} does not divide a replica's batch of {local} "
                             f"(the pipeline runs equal micro-batches)")
        return -(-local // cfg.micro_batch)

    # ---- model and memory ----------------------------------------------------------------------

    def _build(self, ckpt_dir: str | None) -> list[tuple[Shard, DecoderLM]]:
        """This rank's model chunks (one per virtual stage): its shard of each, from the sharding plan,
        weights copied to the device as trainable float32 parameters."""
        dims, m, v = self.dims, self.mesh, self.cfg.virtual_stages
        chunk_dims = ParallelDims(tp=dims.tp, pp=dims.pp * v)
        shapes = ckpt.expected_shapes(self.model_cfg)
        self._replicated, self._zeros, self.cuts, out = [], [], {}, []
        for c in range(v):
            shard, model, _ = build_rank(self.model_cfg, chunk_dims, (c * dims.pp + m.stage) * dims.tp + m.t,
                                         seed=self.cfg.seed, checkpoint=ckpt_dir, partition=self.cfg.partition)
            weights = {n: p.detach().to(self.device, torch.float32, copy=True) for n, p in model.named_parameters()}
            mixed = self.compute_dtype != torch.float32
            bind_weights(model, {n: t.to(self.compute_dtype) for n, t in weights.items()} if mixed else weights)
            for n, w in model.named_parameters():
                w.requires_grad_(True)
                g = shard.global_name(n)
                p = self.params[g] = nn.Parameter(weights[n]) if mixed else w
                self.work.append(w)
                if mixed:  # the pipeline's backward leaves bf16 gradients on w: fold each into the master's
                    w.register_post_accumulate_grad_hook(functools.partial(_fold_grad, p))
                cut = self.cuts[g] = shard.cut(n, shapes[g])
                if shard.replicated(n, shapes[g]):
                    self._replicated.append(p)  # norms, learned positions: gradient summed over the group
                if cut.zero:
                    self._zeros.append(p)  # a row-parallel bias held by tensor rank 0 only: stays zero
            install_tp_hooks(model, shard, m.tp, grads=True)
            if self.cfg.recompute:
                for layer in model.layers:
                    layer.forward = recomputed(layer.forward)
            out.append((shard, model))
        return out

    def _optimizer(self) -> torch.optim.Optimizer:
        params, kw = list(self.params.values()), dict(lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        if self.device.type == "cuda":
            kw["fused"] = True  # one kernel over all parameters (torch's default runs several per tensor group)
        if self.cfg.zero1 and self.dims.dp > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            # the parameters as views of one bucket per rank: the update's broadcast is one call per rank,
            # not one per tensor (each a collective of its own, hundreds a step)
            return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, process_group=self.mesh.dp,
                                           parameters_as_bucket_view=True, **kw)
        return torch.optim.AdamW(params, **kw)

    def _schedule(self):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        pp, v = self.dims.pp, self.cfg.virtual_stages
        modules: list[nn.Module] = list(self.stages)
        if self.cfg.cuda_graphs:  # each chunk's micro-batches as graph replays, one slot for each held at once
            from ..planner.schedule import chunk_peaks, op_order
            from .stage_graphs import GraphedStage

            held = chunk_peaks(op_order(pp, v, self.micro_batches, self.mesh.stage))
            self._grad_acc = [torch.zeros_like(p) for p in self.params.values()]  # the stages' graphs add into them
            acc = {id(w): a for w, a in zip(self.work, self._grad_acc)}
            modules = self._graphed = [
                GraphedStage(st, held[c * pp + self.mesh.stage], [acc[id(w)] for w in st.parameters()])
                for c, st in enumerate(modules)]
        stages = [PipelineStage(st, c * pp + self.mesh.stage, pp * v, self.device, group=self.mesh.pp)
                  for c, st in enumerate(modules)]
        if v == 1:
            return Schedule1F1B(stages[0], self.micro_batches, loss_fn=self._loss, scale_grads=False)
        return ScheduleInterleaved1F1B(stages, self.micro_batches, loss_fn=self._loss, scale_grads=False)

    def memory_model(self) -> MemoryModel:
        """A prior from the model's shape; the job's measured peaks refine it (GPU)."""
        n = sum(p.numel() for p in self.model.parameters())
        act = 2 if self.cfg.dtype == "bfloat16" else 4
        c = self.model_cfg
        fixed, per = estimate(n, 4, self.cfg.seq_len, c.hidden_size, c.num_layers, c.vocab_size, act)
        return MemoryModel(fixed, per)

    def _bf16_copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(w, p) for w, p in zip(self.work, self.params.values()) if w is not p]

    def reserve_parking(self) -> threading.Thread:
        """Allocate the pinned host buffers a pause parks the state in, from another thread while the
        job trains: page-locking them takes seconds, which the first pause would otherwise wait (a
        pause that comes first waits for this to finish). Called after the first step, once the
        optimizer's state exists."""
        def reserve():
            t0 = time.perf_counter()
            n = self.parking.reserve()
            self.log(f"colocation: {_gib(n)} of pinned host buffers reserved for a pause in "
                     f"{time.perf_counter() - t0:.1f} s")

        t = threading.Thread(target=reserve, name="park-reserve", daemon=True)
        t.start()
        return t

    def _pause(self) -> None:
        """Off the device: masters, gradients and AdamW moments parked in pinned host memory
        (``colocate/park.py``); the bf16 copies are dropped, remade from the masters on resume."""
        t0 = time.perf_counter()
        for w, _ in self._bf16_copies():
            w.data = torch.empty(0, dtype=w.dtype, device=self.device)
        self.parking.park()
        mem = self.colo.memory
        fixed, per = mem.coefficients()
        self.log(f"paused: the limit of {_gib(self.colo.limit)} is under the smallest micro-batch's "
                 f"{_gib(mem.predict(1))} (fit {_gib(int(fixed))} + {per / 2**20:.0f} MiB a sample over "
                 f"{len(mem.points)} measured sizes); {_gib(self.parking.parked_bytes)} parked in "
                 f"{(time.perf_counter() - t0) * 1e3:.0f} ms")

    def _resume(self) -> bool:
        """Back on the device, unless an order stops it (False: the state stays parked)."""
        t0 = time.perf_counter()
        if not self.parking.unpark(self.colo.resume_stopped):
            self.log("resume stopped: an order needs the memory again")
            return False
        for w, p in self._bf16_copies():
            w.data = torch.empty(p.shape, dtype=w.dtype, device=self.device)
        self._refresh()
        self.log(f"resumed under a limit of {_gib(self.colo.limit)} in {(time.perf_counter() - t0) * 1e3:.0f} ms")
        return True

    # ---- one step ------------------------------------------------------------------------------

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy over the global batch's token count (the update is the same
        whatever the split into micro-batches and replicas)."""
        total = self.cfg.global_batch * self.cfg.seq_len
        start, stop = self._vocab  # this rank's vocabulary (all of it at tp=1): the head's padding is left out
        return SoftmaxCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), stop - start, start,
                                         self.mesh.tp if self.dims.tp > 1 else None) / total

    def _micro(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        loss = self._loss(self.stages[0](inputs), targets)
        grads = torch.autograd.grad(loss, self.work)
        return loss.detach(), grads  # a tensor: reading it here would stop the host until the GPU is done

    def _accumulate(self, ids: list[int]) -> tuple[float, list[int]]:
        """One replica's batch in micro-batches (the size colocation allows), gradients added up."""
        if self.cfg.cuda_graphs:
            return self._accumulate_graphed(ids)
        pos, loss, sizes, masters = 0, 0.0, [], list(self.params.values())
        # the replica's tokens go to the device at once: a copy from pageable memory stops the host until
        # the device has done all it was given, which once per micro-batch kept the host from running ahead
        inputs, targets = (t.to(self.device) for t in self.data.batch(ids))
        while pos < len(ids):
            left = len(ids) - pos
            m = self.colo.micro_batch(self.cfg.micro_batch)
            m = -(-left // -(-left // m))  # as many micro-batches as size m needs, evened out: 32 by 10 is 4 x 8
            with self.colo.step(m) as s:
                part, grads = self._micro(inputs[pos:pos + m], targets[pos:pos + m])
            if s.abandoned:
                continue  # the same samples again, in the micro-batch that fits now
            if masters[0].grad is None:
                for p, g in zip(masters, grads):
                    p.grad = g.float()
            else:
                torch._foreach_add_([p.grad for p in masters], grads)
            del grads
            loss += part
            sizes.append(m)
            pos += m
        return float(loss), sizes

    def _accumulate_graphed(self, ids: list[int]) -> tuple[float, list[int]]:
        """``_accumulate`` with each micro-batch a CUDA graph replay: the batch's tokens go to the device
        at once (one copy, not one that stops the host per micro-batch), each micro-batch's are copied
        into its graph's input buffers and the graph runs the forward, the backward and the addition
        of the gradients into float32 accumulators, which become the masters' gradients."""
        m = self.cfg.micro_batch
        n = -(-len(ids) // m)
        sizes = [len(ids) // n + (i < len(ids) % n) for i in range(n)]  # evened out, as _accumulate does
        inputs, targets = (t.to(self.device) for t in self.data.batch(ids))  # at once, as _accumulate
        if self._grad_acc is None:
            self._grad_acc = [torch.zeros_like(p) for p in self.params.values()]
            self._graph_pool = torch.cuda.graph_pool_handle()
        torch._foreach_zero_(self._grad_acc)
        loss, pos = torch.zeros((), device=self.device), 0
        for size in sizes:
            g = self._graphs.get(size) or self._capture(size)
            g["inputs"].copy_(inputs[pos:pos + size])
            g["targets"].copy_(targets[pos:pos + size])
            g["graph"].replay()
            loss += g["loss"]
            pos += size
        for p, acc in zip(self.params.values(), self._grad_acc):
            p.grad = acc
        return float(loss), sizes

    def _capture(self, size: int) -> dict:
        """The graph of one micro-batch of ``size`` samples: its static inputs, targets and loss. Two
        eager runs on a side stream come first (libraries allocate their workspaces on a first call,
        which a capture must not see); their gradients are dropped. Every rank captures at the same
        micro-batch, so the collectives inside match."""
        t = self.cfg.seq_len
        inputs = torch.zeros(size, t, dtype=torch.long, device=self.device)
        targets = torch.zeros_like(inputs)
        here = torch.cuda.current_stream(self.device)
        side = side_stream(self.device)
        side.wait_stream(here)
        with torch.cuda.stream(side):
            for _ in range(2):
                torch.autograd.grad(self._loss(self.stages[0](inputs), targets), self.work)
        here.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            loss = self._loss(self.stages[0](inputs), targets)
            grads = torch.autograd.grad(loss, self.work)
            torch._foreach_add_(self._grad_acc, grads)
            loss = loss.detach()
        del grads
        self._graph_bytes = pool_bytes(self.device, self._graph_pool)
        g = self._graphs[size] = {"graph": graph, "inputs": inputs, "targets": targets, "loss": loss}
        self.log(f"captured a CUDA graph of a micro-batch of {size}")
        return g

    def close(self) -> None:
        """Let go of what outlives a step: the colocation link and the captured graphs. Call it before
        the process group is destroyed: a graph that captured NCCL collectives and is still alive makes
        ``destroy_process_group`` wait for ever (pytorch/pytorch#115388)."""
        self.colo.close()
        for g in self._graphs.values():
            g["graph"].reset()
        self._graphs.clear()
        for st in self._graphed:
            st.reset()
        self._graph_bytes = 0

    def _pipeline(self, ids: list[int]) -> tuple[float, list[int]]:
        """One replica's batch through the pipeline schedule (equal micro-batches)."""
        inputs, targets = self.data.batch(ids)
        first, last = self.mesh.stage == 0, self.mesh.stage == self.dims.pp - 1
        losses: list[torch.Tensor] = []
        kw = {} if pipeline_keeps_outputs() else {"return_outputs": False}  # the last stage's logits, unused
        if self.cfg.cuda_graphs:
            torch._foreach_zero_(self._grad_acc)
        self.schedule.step(*((inputs.to(self.device),) if first else ()),
                           target=targets.to(self.device) if last else None, losses=losses, **kw)
        if self.cfg.cuda_graphs:  # the graphs added the gradients into the accumulators
            for p, acc in zip(self.params.values(), self._grad_acc):
                p.grad = acc
        return float(sum(x.detach() for x in losses)) if last else 0.0, [self.cfg.micro_batch] * self.micro_batches

    def _sync_grads(self) -> None:
        """Gradients made whole: replicated parameters summed over the tensor group, a tied
        embedding over its first and last stage, everything over the data-parallel replicas."""
        m, params = self.mesh, list(self.params.values())
        if not m.distributed:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for p in self._zeros:
            p.grad.zero_()
        if self._replicated:
            _all_reduce([p.grad for p in self._replicated], m.tp)
        if m.embed is not None and self.model_cfg.tie_embeddings and "embed_tokens" in self.params:
            _all_reduce([self.params["embed_tokens"].grad], m.embed)
        if self.dims.dp > 1:
            _all_reduce([p.grad for p in params], m.dp)

    def _refresh(self) -> None:
        """The model's bf16 weights from the updated masters (nothing to do when they are the masters)."""
        pairs = self._bf16_copies()
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([w for w, _ in pairs], [p for _, p in pairs])

    def _world_sum(self, x: float) -> float:
        if not self.mesh.distributed:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t)

    def _memory(self) -> tuple[list[int], list[int]]:
        """Per rank, the peak memory and what of it CUDA graphs' private pools hold. The peak: the
        memory allocated this step, plus the pools' room beyond their live tensors (a replay allocates
        nothing, so the allocator's peak would leave its activations out; a step that captures counts
        them twice, allocated and reserved), or the process's peak resident size on the CPU."""
        graphs = 0
        if self.device.type == "cuda":
            graphs = self._graph_bytes + sum(st.pool_bytes for st in self._graphed)
            mine = torch.cuda.max_memory_allocated(self.device) + graphs
        else:
            mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if not self.mesh.distributed:
            return [mine], [graphs]
        t = torch.tensor([mine, graphs], dtype=torch.float64, device=self.device)
        out = [torch.empty_like(t) for _ in range(self.dims.world_size)]
        dist.all_gather(out, t)
        return [int(x[0]) for x in out], [int(x[1]) for x in out]

    def train_step(self) -> dict:
        cfg, dims, m = self.cfg, self.dims, self.mesh
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        ids = self.data.step_samples(self.step_no, cfg.global_batch)
        per = len(ids) // dims.dp
        for p in self.params.values():
            p.grad = None
        loss, sizes = (self._pipeline if self.schedule else self._accumulate)(ids[m.d * per:(m.d + 1) * per])
        self._sync_grads()
        self.opt.step()
        self._refresh()
        # every tensor rank of the last stage holds the same loss: tensor rank 0's counts
        loss = self._world_sum(loss if m.stage == dims.pp - 1 and m.t == 0 else 0.0)
        if cuda:
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        peaks, graphs = self._memory()
        self.step_no += 1
        self.samples_seen.append(ids)
        return {"step": self.step_no, "loss": loss, "micro_batches": sizes, "time_s": dt,
                "tokens_per_s": len(ids) * cfg.seq_len / dt,
                "tflops_per_gpu": self.flops_per_sample * len(ids) / dt / dims.world_size / 1e12,
                "peak_bytes": peaks, "graph_bytes": graphs}

    def _profiler(self):
        cfg = self.cfg
        if cfg.profile is None:
            return None
        from .profile import StepProfiler

        rank = dist.get_rank() if dist.is_initialized() else 0
        return StepProfiler(cfg.profile, cfg.profile_at, cfg.profile_steps, self.device.type == "cuda",
                            cfg.profile_trace, rank, self.log)

    def run(self, on_step=None) -> list[dict]:
        cfg, out = self.cfg, []
        t0, done = time.perf_counter(), 0
        prof = self._profiler()
        try:
            while self.step_no < cfg.steps:
                rec = self._profiled_step(prof)
                if self.step_no == 1 and cfg.colocate and self.parking.pin:
                    self.reserve_parking()
                done += cfg.global_batch
                rec["samples_per_s"] = done / (time.perf_counter() - t0)
                out.append(rec)
                self.log(f"step {rec['step']}/{cfg.steps} loss {rec['loss']:.4f} micro-batches {rec['micro_batches']} "
                         f"{rec['time_s'] * 1e3:.0f} ms {rec['tokens_per_s']:,.0f} tokens/s "
                         f"{rec['tflops_per_gpu']:.3g} TFLOP/s per GPU, peak {max(rec['peak_bytes']) / 2**20:,.0f} MiB "
                         f"(max over {len(rec['peak_bytes'])} ranks)")
                if on_step is not None:
                    on_step(rec)
                if cfg.checkpoint and cfg.checkpoint_every and self.step_no % cfg.checkpoint_every == 0:
                    self.save(cfg.checkpoint)
        finally:
            if prof is not None:
                prof.close()
        if cfg.checkpoint:
            self.save(cfg.checkpoint)
        return out

    def _profiled_step(self, prof) -> dict:
        if prof is None:
            return self.train_step()
        prof.before(self.step_no + 1)
        rec = self.train_step()
        prof.after(self.step_no)
        return rec

    def full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter of the full model (``grads``: its gradient), on the CPU, joined from all
        ranks' shards (a collective: every rank calls it)."""
        mine = {g: (self.cuts[g], (p.grad if grads else p).detach().cpu()) for g, p in self.params.items()}
        if not self.mesh.distributed:
            return {g: t.clone() for g, (_, t) in mine.items()}
        ranks: list = [None] * self.dims.world_size
        dist.all_gather_object(ranks, mine)
        return {g: uncut([r[g] for r in ranks if g in r], shape)
                for g, shape in ckpt.expected_shapes(self.model_cfg).items()}

    # ---- checkpoints ---------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        save_checkpoint(tmp / "model", self.model_cfg, {n: p.detach().cpu() for n, p in self.params.items()})
        moments = {}
        for name, p in self.params.items():
            for k, v in self.opt.state.get(p, {}).items():
                moments[f"{k}.{name}"] = v.detach().cpu().contiguous().reshape(v.shape)
        save_file(moments, str(tmp / "optimizer.safetensors"))
        (tmp / "state.json").write_text(json.dumps({"step": self.step_no, "config": asdict(self.cfg)}, indent=1))
        if path.exists():  # replace the old checkpoint only once the new one is whole
            old = path.with_name(path.name + ".old")
            path.rename(old)
            tmp.rename(path)
            for f in sorted(old.rglob("*"), reverse=True):
                f.unlink() if f.is_file() else f.rmdir()
            old.rmdir()
        else:
            tmp.rename(path)

    def load(self, path: str | Path) -> None:
        from safetensors.torch import load_file

        path = Path(path)
        state = json.loads((path / "state.json").read_text())
        views = {n: torch.empty_like(p, device="cpu") for n, p in self.params.items()}
        load_weights(path / "model", self.model_cfg, views)
        moments = load_file(str(path / "optimizer.safetensors"))
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(views[name])
                st = {k.split(".", 1)[0]: v.to(self.device) for k, v in moments.items() if k.split(".", 1)[1] == name}
                if st:
                    if not self.opt.defaults.get("fused"):
                        st["step"] = st["step"].cpu()  # unfused AdamW keeps its step count on the CPU
                    self.opt.state[p] = st
        self._refresh()
        self.step_no = int(state["step"])
