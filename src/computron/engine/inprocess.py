"""InProcessExecutor: every model on one device of this process (the GPU, or the CPU without one).

What lives here: each model's pinned host image (built at registration), the device arena
(the memory budget less the workspace; weights and KV-cache blocks are regions of it), the
swapper and its copy stream, one ``ModelRunner`` per model, and each running request's blocks
(taken as its sequence grows, released when it ends or is preempted; the whole prompt blocks
that the choices of one prompt share are counted, and released by their last holder). A stopped
request's blocks may move to a host buffer (pinned on a GPU, reused) and back (``Residency.kv_out``,
``kv_in``): the same bytes in new blocks, so it decodes on exactly where it stopped.
The engine core speaks to it only through the ``Executor`` protocol's messages; the arena
checks the scheduler's decisions (an allocation that does not fit is a bug, reported as such).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import format_bytes
from ..memory.arena import Arena, Region
from ..memory.host import HostImage
from ..memory.layout import WeightLayout, layout_for
from ..memory.shared import image_path
from ..memory.units import ALIGN, arena_capacity, staging_bytes
from ..memory.swapper import ImageSwapper, SwapIn
from ..messages import (DeviceStatus, ExecuteBatch, ExecutorStatus, ModelDescription, ModelInfo, Residency,
                        SamplingParams, SeqInput, StepResult)
from ..models import load_weights, resolve_model
from ..models.config import ModelConfig
from ..models.kvcache import KVPool, paged_batch
from .executor import check_stripe
from .graphs import DecodeGraphs
from .runner import ModelRunner
from .sampling import History, Sampler, logprobs, process, sample

CPU_DEFAULT_BUDGET = 2 * 2**30


def _device_size(device: torch.device) -> tuple[int, str]:
    """Bytes a budget on ``device`` can have at most, and what they are."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1], f"of {torch.cuda.get_device_name(device)} ({device})"
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "of this machine's memory (the CPU serves)"


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but no CUDA GPU is available")
    return dev


@dataclass
class _Model:
    cfg: ModelConfig
    layout: WeightLayout
    runner: ModelRunner
    pool: KVPool  # its layers' KV-cache views over the whole arena (block ids: offsets / ALIGN)
    image: HostImage | None = None
    graphs: DecodeGraphs | None = None  # CUDA graphs of its decode step (GPU only)
    answers: bool = True  # this rank samples and returns the tokens (a model's last stage, tensor rank 0)


@dataclass
class _Resident:
    region: Region | None = None
    swap: SwapIn | None = None


@dataclass
class _Seq:
    blocks: list[Region]  # its KV-cache blocks, in token order
    generator: torch.Generator | None
    ids: list[int] | None = None  # the blocks' ids, as of ``ids_at`` compactions of the arena
    ids_at: int = -1
    history: History | None = None  # for penalties and min_tokens; kept across a preemption
    host: torch.Tensor | None = None  # its blocks' bytes in host memory, in order, while they are moved out
    host_blocks: tuple[int, int] = (0, 0)  # how many blocks are in ``host``, and the bytes of each


@dataclass
class _Step:
    """One batch's single step between its launch and the read-back of its tokens."""
    batch: ExecuteBatch
    model: _Model
    seqs: list[_Seq]
    todo: list[SeqInput]
    graph: object = False  # its decode graph, None when it runs eager; False: not looked up yet
    chosen: torch.Tensor | None = None  # the sampled tokens, on the device
    t0: float = 0.0


class InProcessExecutor:
    pin_images = True  # page-locked host images (on a GPU): copies at the link's full speed
    fixed_weights = True  # a model's weights keep their address until evicted or moved (graphs may bake it in)
    stripes = True  # swap-ins may pull through other GPUs' links too (stripe_devices)

    def __init__(self, config, index: int = 0, world: int = 1):
        """``index``: this executor's device among ``world`` (one executor per device, each in a worker
        process of its own, joined by torch.distributed when ``world`` > 1)."""
        self.index, self.world = index, world
        self.device = pick_device(config.device)
        if self.device.type == "cuda" and world > 1:
            self.device = torch.device("cuda", index)
        budget = config.gpu_memory_budget
        if budget is None:
            budget = int(torch.cuda.mem_get_info(self.device)[0] * 0.9) if self.device.type == "cuda" \
                else CPU_DEFAULT_BUDGET
        size, where = _device_size(self.device)
        if budget > size:
            raise ValueError(f"the memory budget of {format_bytes(budget)} is more than the {format_bytes(size)} "
                             f"{where}; give a smaller --gpu-memory-budget")
        self.budget = budget
        arena_bytes = arena_capacity(budget, config.workspace_bytes)
        self.block_tokens = config.kv_block_tokens
        self.graph_batch = config.max_batch_size if (config.cuda_graphs and self.device.type == "cuda"
                                                     and self.fixed_weights) else 0
        self.arena = Arena(arena_bytes, self.device)
        self.stripe_chunk = config.stripe_chunk_bytes
        # Under workers (``world`` > 1) with stripe_devices: the process group of each pair of devices
        # a striped swap-in may join, the images this worker may help to load, and helpers' staging.
        self._pairs: dict[tuple[int, int], object] = {}
        self._helpable: dict[str, tuple[WeightLayout, int]] = {}  # model -> its layout and its device
        self._mapped: dict[str, torch.Tensor] = {}  # model -> its image as another worker holds it (shared)
        self._staging: list[tuple[Region, object]] = []  # staging regions of sends still in flight, their end
        self._streams: list = []  # a stream per batch of a step that runs several models' decode graphs at once
        self.steps_together = 0  # steps that ran several models' decode graphs at once
        self._shm: tuple[int, str] | None = None  # (engine pid, world token) naming shared images
        self._helpers = frozenset(config.stripe_devices)
        self._relay_stream = None  # a helper's stream for its copies and sends (GPU)
        self.swapper = self._swapper(config.stripe_devices)
        self.models: dict[str, _Model] = {}
        self.resident: dict[str, _Resident] = {}
        self.seqs: dict[str, _Seq] = {}
        self._refs: dict[int, int] = {}  # id of a KV block several sequences hold -> how many (choices of a prompt)
        self._host_pool: list[torch.Tensor] = []  # host buffers of caches moved back, for the next move out
        self._lock = threading.Lock()  # registration runs on other threads

    # ---- models --------------------------------------------------------------------------------
    def register(self, desc: ModelDescription, progress: Callable[[str], None] | None = None) -> ModelInfo | None:
        """Build this device's shard of the model. With several devices every executor of the world
        is called (creating a model's process groups is collective); one not in the model's
        placement returns None."""
        pl = desc.placement
        sharded = pl.dims.world_size > 1
        if self.world == 1 and (sharded or pl.devices != (0,)):
            raise ValueError(f"model {desc.name!r}: this executor runs every model on one device "
                             f"(asked for {pl.dims} on devices {list(pl.devices)}); use the workers executor")
        if max(pl.devices) >= self.world:
            raise ValueError(f"model {desc.name!r} is placed on devices {list(pl.devices)}, but there are "
                             f"{self.world}")
        with self._lock:
            if desc.name in self.models:
                raise ValueError(f"a model named {desc.name!r} is already registered")
        cfg, ckpt = resolve_model(desc.source, dtype=desc.dtype)
        pl.dims.validate_for(num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads)
        group = None
        if sharded:
            from ..parallel.collectives import tp_group

            group = tp_group(pl.dims, pl.devices.index(self.index) if self.index in pl.devices else -1, list(pl.devices))
        if self._shm is not None and not sharded and pl.devices[0] != self.index and self.index in self._helpers:
            with self._lock:  # a model another device holds, whose loads this one may help (shared image)
                self._helpable[desc.name] = (layout_for(cfg), pl.devices[0])
        if self.index not in pl.devices:
            return None
        rank = pl.devices.index(self.index)
        if sharded:
            model = self._build_shard(desc, cfg, ckpt, rank, group, progress)
        else:
            model = self._build_whole(desc, cfg, ckpt, progress)
        if ckpt is None and model.answers:
            self._mask_unused_ids(model, cfg)
        self._keep_image(desc.name, model)
        with self._lock:
            if desc.name in self.models:
                raise ValueError(f"a model named {desc.name!r} is already registered")
            self.models[desc.name] = model
        return ModelInfo(desc.name, cfg, ckpt, pl, (self._weight_bytes(model),), (model.cfg.kv_bytes_per_token(),))

    def _swapper(self, stripe: list[int]) -> ImageSwapper:
        """The plain swapper, or a striped one pulling through the host links of the GPUs ``stripe``
        names too (on the CPU, as many host buffers stand for them: the same path, in tests)."""
        if not stripe:
            return ImageSwapper(self.arena)
        if not self.stripes:
            raise ValueError("stripe_devices: this executor copies through one link (the legacy executor, as the "
                             "original did); striped swap-ins are the in-process and worker executors'")
        from ..memory.striped import StripedSwapper

        if self.world > 1:
            return self._linked_swapper(stripe)
        if self.device.type != "cuda":
            return StripedSwapper(self.arena, [torch.device("cpu")] * len(stripe), chunk=self.stripe_chunk)
        count, home = torch.cuda.device_count(), self.device.index or 0
        bad = [d for d in stripe if d >= count or d == home]
        if bad:
            raise ValueError(f"stripe_devices {bad}: a helper must be another of this machine's {count} GPUs "
                             f"than the serving one (cuda:{home})")
        return StripedSwapper(self.arena, [torch.device("cuda", d) for d in stripe], chunk=self.stripe_chunk)

    def _linked_swapper(self, stripe: list[int]) -> ImageSwapper:
        """Under workers: the process group of every pair (a stripe device, another device), made by every
        worker in the same order (making a group is collective), and a world token that names the shared
        host images; the scheduler lends the links load by load (``Residency.stripes``)."""
        import os
        import secrets

        import torch.distributed as dist

        from ..memory.relay import LinkedSwapper

        bad = [d for d in stripe if d >= self.world]
        if bad:
            raise ValueError(f"stripe_devices {bad}: a helper must be one of the {self.world} devices (0 to "
                             f"{self.world - 1})")
        for h in sorted(stripe):
            for d in range(self.world):
                pair = (min(d, h), max(d, h))
                if d != h and pair not in self._pairs:
                    self._pairs[pair] = dist.new_group(list(pair))
        self._pairs = {p: g for p, g in self._pairs.items() if self.index in p}
        token = [secrets.token_hex(4)]
        dist.broadcast_object_list(token, src=0)
        self._shm = (os.getppid(), token[0])
        self.arena.reclaim = lambda: self._reap_staging(wait=True)
        self._relay_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        return LinkedSwapper(self.arena, self.stripe_chunk)

    def _mask_unused_ids(self, model: _Model, cfg: ModelConfig) -> None:
        """A preset's random weights sample from its tokenizer's ids only: the rest of its vocabulary
        has no text (its byte-level BPE has ~1,300 tokens), so a client would get empty completions.
        ``cfg``: the whole model's (a tensor-parallel shard's holds a part of the vocabulary, and its
        logits are gathered whole before the mask)."""
        from ..models.preset_tokenizer import token_ids

        try:
            ids, vocab = token_ids(cfg), cfg.vocab_size
        except ValueError:  # too small a vocabulary for any tokenizer: no text to keep, ids only
            return
        if len(ids) >= vocab:
            return
        mask = torch.full((vocab,), float("-inf"), dtype=model.runner.dtype)
        mask[torch.tensor([i for i in ids if i < vocab])] = 0
        model.runner.model.logit_mask = mask.to(self.device)

    def _check_fits(self, name: str, nbytes: int) -> None:
        if nbytes > self.arena.max_bytes:
            raise ValueError(
                f"model {name!r} needs {format_bytes(nbytes)} of weights"
                f"{f' on device {self.index}' if self.world > 1 else ''}, more than the "
                f"{format_bytes(self.arena.max_bytes)} the memory budget leaves for weights and KV cache "
                f"(budget {format_bytes(self.budget)})")

    def _build_whole(self, desc: ModelDescription, cfg: ModelConfig, ckpt, progress) -> _Model:
        layout = layout_for(cfg)
        self._check_fits(desc.name, layout.nbytes)
        if progress:
            progress(f"building host image of {desc.name} ({format_bytes(layout.nbytes)})")
        # Under workers with stripes the image is built in shared memory: helper workers map it.
        shared = None if self._shm is None else image_path(*self._shm, self.index, desc.name)
        image = HostImage(layout, pin=self.device.type == "cuda" and self.pin_images, shared_path=shared)
        if ckpt is None:
            image.fill_random(cfg, desc.seed, self.device)
        else:
            load_weights(ckpt, cfg, image.views)
        model = _Model(cfg, layout, ModelRunner(cfg), KVPool(self.arena.buffer, cfg, self.block_tokens, ALIGN), image)
        if self.graph_batch:
            model.graphs = DecodeGraphs(self.graph_batch, -(-cfg.max_position // self.block_tokens), self.device)
        return model

    def _build_shard(self, desc: ModelDescription, cfg: ModelConfig, ckpt, rank: int, group, progress) -> _Model:
        """Rank ``rank``'s shard: its own host image (presets: each parameter generated whole and
        sliced; checkpoints: only its slices read), its collectives set on the model."""
        from ..parallel.collectives import StageLinks, install_tp_hooks
        from ..parallel.shard_model import build_rank

        pl = desc.placement
        if progress:
            progress(f"building rank {rank}'s shard of {desc.name} ({pl.dims})")
        shard, net, image = build_rank(cfg, pl.dims, rank, seed=desc.seed, checkpoint=ckpt,
                                       pin=self.device.type == "cuda" and self.pin_images, device=self.device)
        self._check_fits(desc.name, image.nbytes)
        install_tp_hooks(net, shard, group)
        local = shard.config
        runner = ModelRunner(local, net, StageLinks(shard, list(pl.devices)))
        # Only the last stage's first tensor rank samples and answers; graphs do not cover collectives yet.
        return _Model(local, image.layout, runner, KVPool(self.arena.buffer, local, self.block_tokens, ALIGN), image,
                      answers=shard.last and shard.tensor_rank == 0)

    def _keep_image(self, name: str, model: _Model) -> None:
        """Hook for the legacy mechanics, which keep weights per parameter instead."""

    def _weight_bytes(self, model: _Model) -> int:
        return model.layout.nbytes

    def unregister(self, name: str) -> None:
        if name in self.resident:
            self._evict(name)
        with self._lock:
            model = self.models.pop(name, None)
            self._helpable.pop(name, None)
        if model is not None and model.image is not None:
            model.image.drop_shared()
        if name in self._mapped:
            self._reap_staging(wait=True)  # no send may still read the mapping
            del self._mapped[name]

    # ---- residency -----------------------------------------------------------------------------
    def apply(self, change: Residency) -> dict[str, float]:
        if self._staging:
            self._reap_staging()
        for rid in change.release:
            if rid in self.seqs:
                self._release(self.seqs[rid])
        if change.kv_out:
            self._kv_out([self.seqs[r] for r in change.kv_out if r in self.seqs])
        evicted = {}
        for name in change.evict:
            t0 = time.perf_counter()
            self._evict(name)
            evicted[name] = time.perf_counter() - t0
        for name in change.load:
            if name not in self.resident:
                self._load(name, change.stripes.get(name, ()))
        for name, helpers in change.stripes.items():
            if self.index in helpers and name not in self.models:
                self._help(name, helpers)
        for rid in change.kv_in:
            if rid in self.seqs:
                self._kv_in(rid, self.seqs[rid])
        return evicted

    def _kv_out(self, seqs: list[_Seq]) -> None:
        """Copy each sequence's blocks into a host buffer (all copies queued, one wait), then release
        its blocks."""
        moved = []
        for seq in seqs:
            if not seq.blocks or seq.host is not None:
                continue
            if any(id(b) in self._refs for b in seq.blocks):
                raise ValueError("a cache whose blocks other sequences share cannot move to host memory")
            bb = seq.blocks[0].nbytes
            buf, off = self._host_buffer(len(seq.blocks) * bb), 0
            for b in seq.blocks:
                buf[off:off + bb].copy_(b.tensor, non_blocking=True)
                off += bb
            moved.append((seq, buf, (len(seq.blocks), bb)))
        if moved and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the blocks may be reused after this
        for seq, buf, shape in moved:
            self._release(seq)
            seq.host, seq.host_blocks = buf, shape

    def _kv_in(self, rid: str, seq: _Seq) -> None:
        """Take blocks again and copy the sequence's bytes back (queued before its next compute on the
        same stream); its host buffer goes back to the pool."""
        if seq.host is None:
            return
        n, bb = seq.host_blocks
        for i in range(n):
            b = self.arena.allocate(bb, "kv", rid)
            b.tensor.copy_(seq.host[i * bb:(i + 1) * bb], non_blocking=True)
            seq.blocks.append(b)
        seq.ids = None
        self._host_pool.append(seq.host)
        seq.host, seq.host_blocks = None, (0, 0)

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` (a view of the smallest pooled one that is large enough, else a
        new one, page-locked on a GPU)."""
        fits = [i for i, b in enumerate(self._host_pool) if b.numel() >= nbytes]
        if fits:
            i = min(fits, key=lambda i: self._host_pool[i].numel())
            return self._host_pool.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def _load(self, name: str, helpers: tuple[int, ...] = ()) -> None:
        if not helpers:
            region, swap = self.swapper.swap_in(name, self.models[name].image)
        else:
            region, swap = self.swapper.swap_in(name, self.models[name].image, self._links(name, helpers))
        self.resident[name] = _Resident(region, swap)

    def _links(self, name: str, helpers: tuple[int, ...]) -> list[tuple[int, object]]:
        """For a striped load of ``name`` on this device: each helper's rank and the group of the pair."""
        if self._shm is None:
            raise ValueError(f"model {name!r} cannot be loaded striped through devices {list(helpers)}: striped "
                             f"loads of a plan need the worker executor with stripe_devices")
        image = self.models[name].image
        check_stripe(name, (self.index,) if image.shared_path else (), helpers, self._helpers)
        return [(h, self._pairs[min(h, self.index), max(h, self.index)]) for h in helpers]

    def _help(self, name: str, helpers: tuple[int, ...]) -> None:
        """Relay this device's chunks of another device's striped load: from the model's shared image
        (mapped the first time) through staging of this arena (booked by the scheduler on this device's
        budget) to the model's worker. The staging goes back when the last send has ended."""
        from ..memory.host import map_shared
        from ..memory.relay import send_chunks

        if name not in self._helpable:
            raise ValueError(f"model {name!r} is not a model on one other device that device {self.index} may help "
                             f"to load (stripe_devices, a model on one device)")
        layout, home = self._helpable[name]
        src = self._mapped.get(name)
        if src is None:
            src = self._mapped[name] = map_shared(image_path(*self._shm, home, name), layout.nbytes,
                                                  pin=self.device.type == "cuda" and self.pin_images)
        region = self.arena.allocate(staging_bytes(self.stripe_chunk), "staging", f"stripe:{name}")
        try:
            end = send_chunks(src, layout.groups, 1 + helpers.index(self.index), 1 + len(helpers), home,
                              self._pairs[min(home, self.index), max(home, self.index)], region.tensor,
                              self.stripe_chunk, self._relay_stream)
        except BaseException:
            self.arena.release(region)
            raise
        if end is None:
            self.arena.release(region)
        else:
            self._staging.append((region, end))

    def _reap_staging(self, wait: bool = False) -> bool:
        """Give back the staging of helped loads whose last send has ended (waiting for them all when
        ``wait``: the arena needs the bytes). True if any went back."""
        keep = []
        for region, end in self._staging:
            if wait:
                end.synchronize()
            if wait or end.query():
                self.arena.release(region)
            else:
                keep.append((region, end))
        freed = len(keep) < len(self._staging)
        self._staging = keep
        return freed

    def _evict(self, name: str) -> None:
        res = self.resident.pop(name)
        if res.swap is not None and res.swap.events is not None:
            res.swap.events[-1].synchronize()  # a copy still in flight must not land in reused memory
        self.models[name].runner.unbind()
        self.swapper.swap_out(res.region)

    def _bind(self, name: str) -> None:
        """Point the runner at the weights (again, if the arena moved them)."""
        region = self.resident[name].region
        self.models[name].runner.bind((region.offset, region.version, id(region)),
                                      lambda: self.models[name].layout.views(region.tensor))

    # ---- requests ------------------------------------------------------------------------------
    def free(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self._release(seq)

    def _release(self, seq: _Seq) -> None:
        refs = self._refs
        for region in seq.blocks:
            n = refs.get(id(region))
            if n is None:  # its only holder
                self.arena.release(region)
            elif n == 2:
                del refs[id(region)]
            else:
                refs[id(region)] = n - 1
        seq.blocks, seq.ids = [], None
        if seq.host is not None:  # a cache in host memory is dropped too (the request recomputes)
            self._host_pool.append(seq.host)
            seq.host = None

    def _seq(self, model: _Model, s, ahead: int = 0) -> _Seq:
        """The request's state, with blocks for every token it will hold after this step (and
        ``ahead`` more steps of one token each)."""
        seq = self.seqs.get(s.req_id)
        if seq is None:
            gen = None
            if s.params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(s.params.seed)
            seq = self.seqs[s.req_id] = _Seq([], gen)
            if History.needed(s.params):
                seq.history = History(s.tokens, model.runner.cfg.vocab_size, self.device, s.params.penalized)
        if s.past == 0 and (seq.blocks or seq.host is not None):
            self._release(seq)  # a recompute starts from an empty cache
        if s.share is not None and not seq.blocks:
            self._share(seq, s)
        need = -(-(s.past + len(s.tokens) + ahead) // self.block_tokens)
        while len(seq.blocks) < need:
            seq.blocks.append(self.arena.allocate(model.pool.block_bytes, "kv", s.req_id))
        return seq

    def _share(self, seq: _Seq, s: SeqInput) -> None:
        """Start the sequence with the whole blocks of its prompt that another choice holds: the
        same regions, counted (``_refs``) so that the last holder releases them."""
        src, n = self.seqs.get(s.share[0]), s.share[1] // self.block_tokens
        if src is None or len(src.blocks) < n or s.share[1] % self.block_tokens:
            raise ValueError(f"request {s.req_id!r} cannot share the first {s.share[1]} tokens' cache of "
                             f"{s.share[0]!r}: it holds {len(src.blocks) if src else 0} blocks of "
                             f"{self.block_tokens} tokens")
        seq.blocks = src.blocks[:n]
        for region in seq.blocks:
            self._refs[id(region)] = self._refs.get(id(region), 1) + 1

    def _ids(self, seq: _Seq) -> list[int]:
        """Block ids (512-byte units from the arena's start); recomputed only after blocks were
        added or the arena compacted."""
        if seq.ids is None or seq.ids_at != self.arena.compactions or len(seq.ids) != len(seq.blocks):
            seq.ids, seq.ids_at = [b.offset // ALIGN for b in seq.blocks], self.arena.compactions
        return seq.ids

    def execute(self, batches: list[ExecuteBatch]) -> Future:
        fut: Future = Future()
        if self._staging:
            self._reap_staging()
        try:
            result = StepResult()
            together = self._together(batches)
            shared = {id(b) for b in together}
            for batch in batches:
                if id(batch) not in shared:
                    self._run(batch, result)
            if together:
                self._run_together(together, result)
            self._poll_loads(result)
            fut.set_result(result)
        except Exception as e:
            fut.set_exception(e)
        return fut

    def _together(self, batches: list[ExecuteBatch]) -> list[ExecuteBatch]:
        """The batches of a step that replay their models' decode graphs at once, each on its own
        stream (several models a step, ``models_per_step``): single decode steps of warm models with
        a graph for their size, on a GPU, when there are two or more of them."""
        if len(batches) < 2 or self.device.type != "cuda":
            return []
        out = []
        for b in batches:
            m, res = self.models[b.model], self.resident.get(b.model)
            if b.steps == 1 and not b.trace and m.graphs is not None and m.answers and res is not None and \
                    res.swap is None and len(b.seqs) <= self.graph_batch and \
                    all(s.share is None and len(s.tokens) == 1 and s.past > 0 for s in b.seqs):
                out.append(b)
        return out if len(out) > 1 else []

    def _run(self, batch: ExecuteBatch, result: StepResult) -> None:
        if batch.steps > 1:
            return self._run_steps(batch, result)
        self._finish_step(self._start_step(self._take_step(batch), result), result)

    def _run_together(self, batches: list[ExecuteBatch], result: StepResult) -> None:
        """Decode steps of several models at once: every batch's blocks are taken first (which may
        compact the arena: nothing may run meanwhile), then each replays its graph and samples on a
        stream of its own, and the tokens are read back once all have been queued. An H200 runs two
        to six small OPT-1.3B steps so in 0.30-0.42 of the time each adds alone
        (bench/concurrent_steps.py)."""
        main = torch.cuda.current_stream(self.device)
        while len(self._streams) < len(batches):
            self._streams.append(torch.cuda.Stream(self.device))
        pending = [self._take_step(b) for b in batches]
        for p in pending:  # captured here, on the engine's stream, if new: never while the others run
            p.graph = self._step_graph(p)
        for p, stream in zip(pending, self._streams):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                self._start_step(p, result)
        for stream in self._streams[:len(batches)]:
            main.wait_stream(stream)
        for p in pending:
            self._finish_step(p, result)
        self.steps_together += 1

    def _take_step(self, batch: ExecuteBatch) -> _Step:
        """A step's sequences with their blocks taken (this may compact the arena)."""
        model = self.models[batch.model]
        seqs = [self._seq(model, s) for s in batch.seqs]
        return _Step(batch, model, seqs, [self._computed(s) for s in batch.seqs])

    def _step_graph(self, p: _Step):
        """The model's decode graph for this step's batch, if it runs as one (captured if new)."""
        model, res, todo = p.model, self.resident[p.batch.model], p.todo
        self._bind(p.batch.model)
        if model.graphs is not None and res.swap is None and not p.batch.trace and \
                all(len(s.tokens) == 1 and s.past > 0 for s in todo):
            return model.graphs.get(model.runner, model.pool, len(p.seqs), res.region.tensor.data_ptr())
        return None

    def _start_step(self, p: _Step, result: StepResult) -> _Step:
        """Queue the step's forward and sampling on the current stream (the tokens stay on the device)."""
        batch, model, seqs, todo = p.batch, p.model, p.seqs, p.todo
        name = batch.model
        runner = model.runner
        if p.graph is False:
            p.graph = self._step_graph(p)
        self._bind(name)
        ids = [self._ids(q) for q in seqs]
        res = self.resident[name]
        if batch.trace:
            runner.trace = []
        p.t0 = time.perf_counter()
        graph = p.graph
        prompt = []  # (sequence, first row) of the prefills that want their tokens' log-probabilities
        if graph is not None:
            bt = self.block_tokens
            logits = graph.run([s.tokens[0] for s in todo], [s.past for s in todo],
                               [b[s.past // bt] * bt + s.past % bt for b, s in zip(ids, todo)],
                               [s.past + 1 for s in todo], ids)
        else:
            attn = paged_batch(model.pool, [(b, s.past, len(s.tokens)) for b, s in zip(ids, todo)], self.device)
            tok, pos = [], []
            for i, s in enumerate(todo):
                if s.prompt_logprobs is not None:
                    prompt.append((i, len(tok)))
                tok.extend(s.tokens)
                pos.extend(range(s.past, s.past + len(s.tokens)))
            ids_t = torch.tensor([tok, pos], dtype=torch.long).to(self.device, non_blocking=True)
            rows = None
            if prompt:  # the last rows, then every row but the last of those prefills
                extra = [r for i, at in prompt for r in range(at, at + len(todo[i].tokens) - 1)]
                rows = torch.cat([attn.last, torch.tensor(extra, dtype=torch.long).to(self.device)])
            logits = runner.forward(ids_t[0], ids_t[1], attn, res.swap, rows)
        if model.answers:
            if prompt:
                logits, before = logits[:len(todo)], logits[len(todo):]
                self._prompt_logprobs(todo, prompt, before, result)
            params = [s.params for s in todo]
            p.chosen = sample(process(logits, params, [q.history for q in seqs], model.runner.cfg.eos_token_id),
                              params, [q.generator for q in seqs])
            for s, lp in zip(todo, logprobs(logits, p.chosen, [q.logprobs for q in params])):
                if lp is not None:
                    result.logprobs[s.req_id] = lp
        return p

    def _finish_step(self, p: _Step, result: StepResult) -> None:
        """Read the step's tokens back (waiting for the device) and book them."""
        name, seqs, todo = p.batch.model, p.seqs, p.todo
        res = self.resident[name]
        if p.chosen is not None:
            tokens = p.chosen.tolist()
            result.tokens.update((s.req_id, t) for s, t in zip(todo, tokens))
            for q, t in zip(seqs, tokens):
                if q.history is not None:
                    q.history.add(t)
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's time is its device work's
        result.compute_s[name] = time.perf_counter() - p.t0
        if p.batch.trace:
            result.trace[name] = self._trace(res.swap, p.model.runner)
        if res.swap is not None:
            result.loaded[name] = res.swap.seconds()
            res.swap = None  # loaded: later steps need not wait on its events

    @staticmethod
    def _computed(s: SeqInput) -> SeqInput:
        """What a sequence computes: a prefill sharing its prompt's first blocks only the rest."""
        if s.share is None:
            return s
        n = s.share[1]
        return SeqInput(s.req_id, s.tokens[n:], n, s.params)

    def _prompt_logprobs(self, todo: list[SeqInput], prompt: list[tuple[int, int]], before: torch.Tensor,
                         result: StepResult) -> None:
        """Each asking prefill's tokens after the first, scored by the logits of the row before each."""
        nxt = [t for i, _ in prompt for t in todo[i].tokens[1:]]
        ks = [todo[i].prompt_logprobs for i, _ in prompt for _ in todo[i].tokens[1:]]
        lps = logprobs(before, torch.tensor(nxt, dtype=torch.long).to(before.device), ks)
        at = 0
        for i, _ in prompt:
            n = len(todo[i].tokens) - 1
            result.prompt_logprobs[todo[i].req_id] = lps[at:at + n]
            at += n

    def _run_steps(self, batch: ExecuteBatch, result: StepResult) -> None:
        """Decode steps back to back, each sequence's token fed to its next step on the device:
        the host waits for the device once, for the whole run's tokens. Rows whose sampling needs
        the host between steps (``hosted``), a trace or a copy still in flight take one step at a
        time instead."""
        name = batch.model
        model = self.models[name]
        if not model.answers:
            raise ValueError(f"model {name!r}: this rank does not sample, so it cannot feed a run of "
                             f"{batch.steps} decode steps")
        if batch.trace or self.resident[name].swap is not None or any(hosted(s.params) for s in batch.seqs):
            return self._run_steps_hosted(batch, result)
        k, bt = batch.steps, self.block_tokens
        seqs = [self._seq(model, s, ahead=k - 1) for s in batch.seqs]  # every block of the run, before binding
        self._bind(name)
        ids = [self._ids(q) for q in seqs]
        res, runner = self.resident[name], model.runner
        past = [s.past for s in batch.seqs]
        draw = Sampler([s.params for s in batch.seqs], runner.cfg.vocab_size, self.device)
        gens = [q.generator for q in seqs]
        t0 = time.perf_counter()
        graph = None if model.graphs is None else \
            model.graphs.get(runner, model.pool, len(seqs), res.region.tensor.data_ptr())
        first = [s.tokens[0] for s in batch.seqs]
        if graph is not None:
            graph.plan_run(first, [[p + j for p in past] for j in range(k)],
                           [[b[(p + j) // bt] * bt + (p + j) % bt for b, p in zip(ids, past)] for j in range(k)],
                           [[p + j + 1 for p in past] for j in range(k)], ids)
        tokens = torch.tensor(first, dtype=torch.long).to(self.device, non_blocking=True)
        out = []
        for j in range(k):
            if graph is not None:
                logits = graph.run_planned(j, tokens if j else None)
            else:
                attn = paged_batch(model.pool, [(b, p + j, 1) for b, p in zip(ids, past)], self.device)
                pos = torch.tensor([p + j for p in past], dtype=torch.long).to(self.device, non_blocking=True)
                logits = runner.forward(tokens, pos, attn)
            tokens = draw(logits, gens)
            out.append(tokens)
        runs = torch.stack(out, dim=1).tolist()  # the run's one wait for the device
        result.tokens.update((s.req_id, t) for s, t in zip(batch.seqs, runs))
        result.compute_s[name] = time.perf_counter() - t0

    def _run_steps_hosted(self, batch: ExecuteBatch, result: StepResult) -> None:
        """Decode steps one call each, each sequence's token fed to its next step from the host."""
        seqs, runs, compute = batch.seqs, {s.req_id: [] for s in batch.seqs}, 0.0
        for _ in range(batch.steps):
            one = StepResult()
            self._run(ExecuteBatch(batch.model, seqs, batch.trace), one)
            compute += one.compute_s[batch.model]
            result.loaded.update(one.loaded)
            result.trace.update(one.trace)
            for rid, t in one.tokens.items():
                runs[rid].append(t)
            for rid, lp in one.logprobs.items():
                result.logprobs.setdefault(rid, []).append(lp)
            seqs = [SeqInput(s.req_id, [one.tokens[s.req_id]], s.past + len(s.tokens), s.params) for s in seqs]
        result.tokens.update(runs)
        result.compute_s[batch.model] = compute

    @staticmethod
    def _trace(swap: SwapIn | None, runner: ModelRunner) -> dict:
        events, runner.trace = runner.trace, None
        if swap is None or swap.events is None:
            return {}
        return {"copy_end_s": [swap.start.elapsed_time(e) / 1e3 for e in swap.events],
                "compute_start_s": [swap.start.elapsed_time(e) / 1e3 for e in events]}

    def _poll_loads(self, result: StepResult, wait: bool = False) -> None:
        """Report loads whose copies ended (waiting for those in flight only when asked)."""
        for name, res in self.resident.items():
            if res.swap is not None and (wait or res.swap.done()):
                result.loaded[name] = res.swap.seconds()
                res.swap = None

    def wait_loads(self) -> dict[str, float]:
        result = StepResult()
        self._poll_loads(result, wait=True)
        return result.loaded

    # ---- status --------------------------------------------------------------------------------
    def status(self) -> ExecutorStatus:
        if self._staging:
            self._reap_staging()
        a = self.arena
        dev = DeviceStatus(self.index, str(self.device), a.max_bytes, a.used("weights"), a.used("kv"), a.compactions,
                           self.budget, a.nbytes)
        models = {n: "loading" if r.swap is not None and not r.swap.done() else "resident"
                  for n, r in self.resident.items()}
        graphs = [m.graphs for m in self.models.values() if m.graphs is not None]
        stats = {"graph_captures": sum(g.captures for g in graphs), "graph_capture_s": sum(g.capture_s for g in graphs),
                 "graph_recapture_s": sum(g.recapture_s for g in graphs), "arena_backed_bytes": a.backed,
                 "steps_together": self.steps_together}
        if self._shm is not None:  # staging this device lends to striped loads now (0 once their sends end)
            stats["stripe_staging_bytes"] = a.used("staging")
        return ExecutorStatus([dev], models, self.block_tokens, stats)

    def resize(self, device: int, nbytes: int) -> int:
        if device != self.index:
            raise ValueError(f"this executor holds device {self.index}, not {device}")
        return self.arena.resize(nbytes)  # regions that move are re-bound (versions) before their next use

    def probe_link(self, name: str, repeats: int) -> list[float]:
        src = self.models[name].image.buffer
        region = self.arena.allocate(src.numel(), "weights", "link-probe")
        try:
            return [_timed_copy(region.tensor[: src.numel()], src) for _ in range(repeats)]
        finally:
            self.arena.release(region)

    def weights_digest(self, name: str) -> str:
        """A digest of the model's weights as this device holds them now (its region, once its copies
        have ended): tests and operators compare a load with the host image it came from."""
        import hashlib

        res = self.resident[name]
        if res.swap is not None and res.swap.events is not None:
            res.swap.events[-1].synchronize()  # not reported as loaded here: the engine's step does that
        region = res.region
        return hashlib.sha256(region.tensor[: self.models[name].layout.nbytes].cpu().numpy().data).hexdigest()

    def image_digest(self, name: str) -> str:
        """A digest of the model's host image on this device (what ``weights_digest`` must equal)."""
        import hashlib

        return hashlib.sha256(self.models[name].image.buffer.numpy().data).hexdigest()  # no copy of the image

    def shutdown(self) -> None:
        for name in list(self.resident):
            self._evict(name)
        if self._staging:
            self._reap_staging(wait=True)


def hosted(p: SamplingParams) -> bool:
    """Does a row's sampling need the host between decode steps (its logits processors: penalties,
    min_tokens, a logit bias; or its log-probabilities)? Rows that do not can be fed their previous
    token on the device."""
    return History.needed(p) or bool(p.logit_bias) or p.logprobs is not None


def _timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    if dst.is_cuda:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0
