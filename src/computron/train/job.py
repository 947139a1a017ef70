"""The built-in training job: a decoder of this project on token data, AdamW, gradient accumulation.

What flows through: each step takes a fixed global batch of samples (``data.py``), split into
micro-batches whose size may change from one micro-batch to the next (colocation picks it, see
``colocate/client.py``). A micro-batch's loss is its summed token cross-entropy divided by the
global batch's token count, and its gradients (``autograd.grad``, so an abandoned micro-batch
leaves nothing behind) are added into the accumulators; so the update is the same whatever the
split. Weights, gradients and AdamW moments are float32 on the job's device (CPU or GPU); on the
GPU ``--dtype bfloat16`` runs the forward and backward under bf16 autocast.

Parallelism: the job is written for one process per rank. ``ParallelDims`` is taken and validated
now; data parallelism adds a slice of ``step_samples`` per rank and a gradient all-reduce in
``_sync_grads``; tensor and pipeline parallelism a sharded model from ``parallel/`` in
``_build``. Only dp=tp=pp=1 runs today.

Checkpoints (safetensors only): ``DIR/model`` is a servable checkpoint (config.json +
model.safetensors, ``save_checkpoint``), ``DIR/optimizer.safetensors`` the AdamW moments, and
``DIR/state.json`` the step and the job's config; ``resume`` continues from it bit for bit.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from ..colocate.client import Colocation
from ..colocate.memmodel import MemoryModel, estimate
from ..models import load_tokenizer, load_weights, resolve_model, save_checkpoint
from ..models.transformer import DecoderLM, DenseBatch, bind_weights
from ..parallel.dims import ParallelDims
from .config import TrainConfig
from .data import TokenData


class Trainer:
    def __init__(self, cfg: TrainConfig, log=None):
        self.cfg, self.log = cfg, log or (lambda s: None)
        self.dims = ParallelDims(**cfg.dims)
        if self.dims.world_size != 1:
            raise ValueError(f"this job runs one process for now; got {self.dims}")
        self.device = torch.device(cfg.device)
        if cfg.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {cfg.dtype!r}")
        self.model_cfg, ckpt_dir = resolve_model(cfg.model, dtype="float32")
        self.model = self._build(ckpt_dir)
        self.params = dict(self.model.named_parameters())
        self.opt = torch.optim.AdamW(self.params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.data = (TokenData.from_text(cfg.data, load_tokenizer(ckpt_dir, self.model_cfg), cfg.seq_len, cfg.seed)
                     if cfg.data else
                     TokenData.synthetic(self.model_cfg.vocab_size, cfg.synthetic_tokens, cfg.seq_len, cfg.seed))
        self.step_no = 0
        self.samples_seen: list[list[int]] = []  # per step, the sample ids in the order they were used
        cuda = self.device.type == "cuda"
        self.colo = Colocation(cfg.colocate, cfg.colocate_device, self.memory_model(),
                               on_pause=lambda: self.offload(torch.device("cpu")),
                               on_resume=lambda: self.offload(self.device),
                               release=torch.cuda.empty_cache if cuda else (lambda: None),
                               measure=(torch.cuda.reset_peak_memory_stats, torch.cuda.max_memory_allocated)
                               if cuda else None)
        self.colo.watch(self.model)
        if cfg.resume and cfg.checkpoint and (Path(cfg.checkpoint) / "state.json").is_file():
            self.load(cfg.checkpoint)

    # ---- model and memory ----------------------------------------------------------------------

    def _build(self, ckpt_dir: str | None) -> DecoderLM:
        from ..memory.host import HostImage
        from ..memory.layout import WeightLayout

        model = DecoderLM(self.model_cfg)
        layout = WeightLayout.of(model, torch.float32)
        image = HostImage(layout, pin=False)
        if ckpt_dir is None:
            image.fill_random(self.model_cfg, self.cfg.seed)
        else:
            load_weights(ckpt_dir, self.model_cfg, image.views)
        bind_weights(model, {n: v.to(self.device, copy=True) for n, v in image.views.items()})
        for p in model.parameters():
            p.requires_grad_(True)
        return model

    def memory_model(self) -> MemoryModel:
        """A prior from the model's shape; the job's measured peaks refine it (GPU)."""
        n = sum(p.numel() for p in self.model.parameters())
        act = 2 if self.cfg.dtype == "bfloat16" else 4
        c = self.model_cfg
        fixed, per = estimate(n, 4, self.cfg.seq_len, c.hidden_size, c.num_layers, c.vocab_size, act)
        return MemoryModel(fixed, per)

    def offload(self, device: torch.device) -> None:
        """Move weights, gradients and optimizer state to ``device`` (pause: off the GPU; resume: back)."""
        for p in self.params.values():
            p.data = p.data.to(device)
            if p.grad is not None:
                p.grad = p.grad.to(device)
            for k, v in self.opt.state.get(p, {}).items():
                if torch.is_tensor(v) and k != "step":
                    self.opt.state[p][k] = v.to(device)

    # ---- one step ------------------------------------------------------------------------------

    def _micro(self, ids: list[int], total_tokens: int) -> tuple[float, list[torch.Tensor]]:
        inputs, targets = self.data.batch(ids)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        m, t = inputs.shape
        positions = torch.arange(t, device=self.device).repeat(m)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.dtype == "bfloat16"):
            logits = self.model(inputs.reshape(-1), positions, DenseBatch(m))
        loss = F.cross_entropy(logits.float(), targets.reshape(-1), reduction="sum") / total_tokens
        grads = torch.autograd.grad(loss, list(self.params.values()))
        return float(loss.detach()), grads

    def _sync_grads(self) -> None:
        """Data parallel: all-reduce the accumulated gradients here (one rank today: nothing to do)."""

    def train_step(self) -> dict:
        cfg = self.cfg
        ids = self.data.step_samples(self.step_no, cfg.global_batch)
        total = len(ids) * cfg.seq_len
        pos, loss, sizes, used = 0, 0.0, [], []
        for p in self.params.values():
            p.grad = None
        while pos < len(ids):
            m = min(self.colo.micro_batch(cfg.micro_batch), len(ids) - pos)
            with self.colo.step(m) as s:
                part, grads = self._micro(ids[pos:pos + m], total)
            if s.abandoned:
                continue  # the same samples again, in the micro-batch that fits now
            for p, g in zip(self.params.values(), grads):
                p.grad = g if p.grad is None else p.grad.add_(g)
            del grads
            loss += part
            sizes.append(m)
            used += ids[pos:pos + m]
            pos += m
        self._sync_grads()
        self.opt.step()
        self.step_no += 1
        self.samples_seen.append(used)
        return {"step": self.step_no, "loss": loss, "micro_batches": sizes}

    def run(self, on_step=None) -> list[dict]:
        cfg, out = self.cfg, []
        t0, done = time.perf_counter(), 0
        while self.step_no < cfg.steps:
            rec = self.train_step()
            done += cfg.global_batch
            rec["samples_per_s"] = done / (time.perf_counter() - t0)
            out.append(rec)
            self.log(f"step {rec['step']}/{cfg.steps} loss {rec['loss']:.4f} micro-batches {rec['micro_batches']} "
                     f"{rec['samples_per_s']:.1f} samples/s")
            if on_step is not None:
                on_step(rec)
            if cfg.checkpoint and cfg.checkpoint_every and self.step_no % cfg.checkpoint_every == 0:
                self.save(cfg.checkpoint)
        if cfg.checkpoint:
            self.save(cfg.checkpoint)
        return out

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
                    st["step"] = st["step"].cpu()  # AdamW keeps its step count on the CPU
                    self.opt.state[p] = st
        self.step_no = int(state["step"])
