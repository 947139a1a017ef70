"""Executors: where models live and run. The engine speaks to one through typed messages.

``InProcessExecutor`` serves every model on one device in this process: it owns the arena (the
device memory budget), the swapper, the KV-cache blocks and one ``ModelRunner`` per model.
A multi-GPU executor (one worker process per GPU) implements the same four calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..memory.arena import Arena, Region
from ..memory.host import HostImage
from ..memory.swapper import ImageSwapper, LegacySwapper, SwapIn
from ..messages import ExecuteBatch, StepResult
from ..models.config import ModelConfig
from ..models.transformer import TORCH_DTYPES, AttnBatch
from .runner import ModelRunner
from .sampling import sample


@dataclass
class _Resident:
    region: Region | None = None  # image mode
    swap: SwapIn | None = None
    legacy: dict | None = None  # legacy mode: name -> device tensor


@dataclass
class _Seq:
    region: Region
    capacity: int
    generator: torch.Generator | None


class InProcessExecutor:
    def __init__(self, device: str | torch.device, arena_bytes: int, legacy: bool = False):
        self.device = torch.device(device)
        self.arena = Arena(arena_bytes, self.device)
        self.legacy = legacy
        self.swapper = LegacySwapper(self.device) if legacy else ImageSwapper(self.arena)
        self.cfgs: dict[str, ModelConfig] = {}
        self.images: dict[str, HostImage] = {}
        self.legacy_host: dict[str, dict[str, torch.Tensor]] = {}
        self.runners: dict[str, ModelRunner] = {}
        self.resident: dict[str, _Resident] = {}
        self.seqs: dict[str, _Seq] = {}

    # ---- models ------------------------------------------------------------------------------
    def register(self, name: str, cfg: ModelConfig, image: HostImage) -> None:
        self.cfgs[name] = cfg
        self.runners[name] = ModelRunner(cfg)
        if self.legacy:
            # The original kept per-parameter host tensors, pageable until the first eviction
            # replaced them with pinned ones (the image then goes with its last view).
            self.legacy_host[name] = dict(image.views)
        else:
            self.images[name] = image

    def unregister(self, name: str) -> None:
        if name in self.resident:
            self.evict(name)
        for d in (self.cfgs, self.images, self.legacy_host, self.runners):
            d.pop(name, None)

    def load(self, name: str) -> None:
        if name in self.resident:
            return
        runner = self.runners[name]
        if self.legacy:
            dev, swap = self.swapper.swap_in(self.legacy_host[name])
            runner.bind(id(dev), dev)
            self.resident[name] = _Resident(legacy=dev, swap=swap)
            return
        region, swap = self.swapper.swap_in(name, self.images[name])
        self.resident[name] = _Resident(region=region, swap=swap)
        self._bind(name)

    def evict(self, name: str) -> float:
        t0 = time.perf_counter()
        res = self.resident.pop(name)
        if res.swap is not None and res.swap.events is not None:
            res.swap.events[-1].synchronize()  # a copy still in flight must not land in reused memory
        self.runners[name].unbind()
        if self.legacy:
            self.legacy_host[name] = self.swapper.swap_out(res.legacy)
        else:
            self.swapper.swap_out(res.region)
        return time.perf_counter() - t0

    def _bind(self, name: str) -> None:
        res = self.resident[name]
        if res.region is not None:
            key = (res.region.offset, res.region.version, id(res.region))
            if key != self.runners[name]._bound_key:
                self.runners[name].bind(key, self.images[name].layout.views(res.region.tensor))

    # ---- requests ----------------------------------------------------------------------------
    def free(self, req_id: str) -> None:
        seq = self.seqs.pop(req_id, None)
        if seq is not None:
            self.arena.release(seq.region)

    def _seq(self, cfg: ModelConfig, s) -> _Seq:
        seq = self.seqs.get(s.req_id)
        if seq is None:
            region = self.arena.allocate(s.capacity * cfg.kv_bytes_per_token(), "kv", s.req_id)
            gen = None
            if s.params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(s.params.seed)
            seq = self.seqs[s.req_id] = _Seq(region, s.capacity, gen)
        return seq

    def execute(self, batch: ExecuteBatch) -> StepResult:
        name = batch.model
        cfg, runner = self.cfgs[name], self.runners[name]
        dtype = TORCH_DTYPES[cfg.dtype]
        seqs = [self._seq(cfg, s) for s in batch.seqs]  # may compact the arena: bind afterwards
        self._bind(name)
        shape = (cfg.num_layers, 2, cfg.kv_heads, 0, cfg.head_dim)
        caches = [q.region.tensor[: q.capacity * cfg.kv_bytes_per_token()].view(dtype).view(*shape[:3], q.capacity, shape[4]) for q in seqs]
        ids, pos, starts, lengths, past = [], [], [], [], []
        for s in batch.seqs:
            starts.append(len(ids))
            lengths.append(len(s.tokens))
            past.append(s.past)
            ids.extend(s.tokens)
            pos.extend(range(s.past, s.past + len(s.tokens)))
        ids_t = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos_t = torch.tensor(pos, dtype=torch.long).to(self.device, non_blocking=True)
        res = self.resident[name]
        t0 = time.perf_counter()
        logits = runner.forward(ids_t, pos_t, AttnBatch(starts, lengths, past, caches), res.swap)
        tokens = sample(logits, [s.params for s in batch.seqs], [q.generator for q in seqs]).tolist()
        result = StepResult({s.req_id: t for s, t in zip(batch.seqs, tokens)},
                            compute_s=time.perf_counter() - t0)
        if res.swap is not None:
            result.load_s[name] = res.swap.seconds()
            res.swap = None  # loaded: later steps need not wait on its events
        return result

    def memory(self) -> dict[str, int]:
        return {"weights": self.arena.used("weights"), "kv": self.arena.used("kv"), "total": self.arena.nbytes}
