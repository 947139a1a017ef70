"""Engine: registered models, live requests, and the step loop (schedule → swap → execute → update).

Lives on the host. Text comes in, token ids go to the executor, token ids come back and are
detokenised here; stop strings, EOS and max_tokens end a request. Every request submitted ends
with exactly one of: finished (``finish_reason`` stop/length), failed (``error``), or aborted.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import EngineConfig, ModelSpec, format_bytes
from ..memory.host import HostImage
from ..memory.layout import align_up, layout_for
from ..messages import ExecuteBatch, SeqInput
from ..models import IncrementalDecoder, load_tokenizer, load_weights, resolve_model
from ..models.config import ModelConfig
from ..scheduler import SchedRequest, Scheduler, SchedulerConfig
from .executor import InProcessExecutor
from .sampling import SamplingParams


class EngineError(ValueError):
    """Bad input from a user (unknown model, prompt too long, bad parameters): a 4xx, not a crash."""


@dataclass(eq=False)
class Request:
    id: str
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    load_s: float = 0.0  # swap-in seconds of a load this request waited for
    evict_s: float = 0.0
    compute_s: float = 0.0  # wall time of the steps it took part in (forward + sampling)
    # Called as (request, new text) after every generated token (the text may be "" while a
    # character or a possible stop string is incomplete) and once more when the request ends.
    on_update: Callable[["Request", str], None] | None = None
    decoder: IncrementalDecoder | None = None
    _emitted: int = 0  # chars of text already reported

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ModelEntry:
    name: str
    source: str
    cfg: ModelConfig
    tokenizer: object
    nbytes: int
    checkpoint: str | None


@dataclass
class PreparedModel:
    """A model whose host image is built, not yet known to the scheduler or executor."""

    spec: ModelSpec
    entry: ModelEntry
    image: HostImage


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device {device!r} asked for, but no CUDA GPU is available")
    return dev


class Engine:
    def __init__(self, config: EngineConfig | None = None):
        self.config = cfg = config or EngineConfig()
        self.device = pick_device(cfg.device)
        budget = cfg.gpu_memory_budget
        if budget is None:
            budget = int(torch.cuda.mem_get_info(self.device)[0] * 0.9) if self.device.type == "cuda" else 2 * 2**30
        workspace = cfg.workspace_bytes if cfg.workspace_bytes is not None else min(budget // 10, 2 * 2**30)
        if workspace >= budget:
            raise EngineError(f"workspace of {format_bytes(workspace)} leaves nothing of the {format_bytes(budget)} budget")
        self.budget = budget
        self.arena_bytes = align_up(budget - workspace) - 512
        self.executor = InProcessExecutor(self.device, self.arena_bytes, legacy=cfg.policy == "computron")
        self.scheduler = Scheduler(SchedulerConfig(
            budget=self.arena_bytes, policy=cfg.policy, max_batch_size=cfg.max_batch_size,
            max_tokens_per_step=cfg.max_tokens_per_step, max_loaded=cfg.max_loaded, prefetch=cfg.prefetch))
        self.models: dict[str, ModelEntry] = {}
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.stats = {"swap_ins": 0, "evictions": 0, "swap_in_bytes": 0, "swap_in_seconds": 0.0, "steps": 0}
        # Called on every swap as listener(kind, model, seconds, nbytes), kind "load" or "evict"
        # (metrics, benchmarks). A load reports its copy seconds once its first step ran.
        self.listeners: list[Callable[[str, str, float, int], None]] = []

    # ---- models ------------------------------------------------------------------------------
    def register_model(self, spec: ModelSpec | str, progress: Callable[[str], None] | None = None) -> ModelEntry:
        """Build a model's host image and add it; see ``build_model`` and ``add_model``."""
        return self.add_model(self.build_model(spec, progress))

    def build_model(self, spec: ModelSpec | str, progress: Callable[[str], None] | None = None) -> PreparedModel:
        """The slow half of registration: read the config, build and fill the host image.

        Reads only the engine's fixed settings, so it may run on another thread while the engine
        keeps serving (the server registers models at run time this way)."""
        spec = ModelSpec.parse(spec) if isinstance(spec, str) else spec
        if spec.name in self.models:
            raise EngineError(f"a model named {spec.name!r} is already registered")
        try:
            cfg, ckpt = resolve_model(spec.source, dtype=spec.dtype)
        except (KeyError, ValueError, FileNotFoundError) as e:
            raise EngineError(str(e.args[0]) if e.args else str(e)) from None
        layout = layout_for(cfg)
        if layout.nbytes > self.arena_bytes:
            raise EngineError(
                f"model {spec.name!r} needs {format_bytes(layout.nbytes)} of weights, more than the "
                f"{format_bytes(self.arena_bytes)} the memory budget leaves for weights and KV cache "
                f"(budget {format_bytes(self.budget)})")
        if progress:
            progress(f"building host image of {spec.name} ({format_bytes(layout.nbytes)})")
        # The computron policy starts from ordinary (pageable) host memory, as the original did.
        image = HostImage(layout, pin=self.device.type == "cuda" and self.config.policy != "computron")
        if ckpt is None:
            image.fill_random(cfg, spec.seed, self.device)
        else:
            load_weights(ckpt, cfg, image.views)
        entry = ModelEntry(spec.name, spec.source, cfg, load_tokenizer(ckpt, cfg), layout.nbytes, ckpt)
        return PreparedModel(spec, entry, image)

    def add_model(self, prepared: PreparedModel) -> ModelEntry:
        """The quick half of registration (on the engine's thread): make a built model servable."""
        entry = prepared.entry
        if entry.name in self.models:
            raise EngineError(f"a model named {entry.name!r} is already registered")
        self.executor.register(entry.name, entry.cfg, prepared.image)
        self.scheduler.add_model(entry.name, entry.nbytes, pinned=prepared.spec.pinned)
        self.models[entry.name] = entry
        return entry

    def unregister_model(self, name: str) -> None:
        self._entry(name)
        try:
            self.scheduler.remove_model(name)  # refuses while requests are in flight
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.executor.unregister(name)
        del self.models[name]

    def model_state(self, name: str) -> str:
        self._entry(name)
        res = self.executor.resident.get(name)
        if res is None:
            return "offloaded"
        return "loading" if res.swap is not None and not res.swap.done() else "resident"

    def load(self, name: str) -> None:
        """Admin: swap a model in now, evicting idle ones as the scheduler would."""
        self._entry(name)
        try:
            self._swap(self.scheduler.plan_load(name))
        except ValueError as e:
            raise EngineError(str(e)) from None

    def offload(self, name: str) -> None:
        self._entry(name)
        if name in self.executor.resident:
            try:
                self.scheduler.mark_evicted(name)
            except ValueError as e:
                raise EngineError(str(e)) from None
            self._evict(name)

    def set_pinned(self, name: str, pinned: bool) -> None:
        self._entry(name)
        self.scheduler.set_pinned(name, pinned)

    def _entry(self, name: str) -> ModelEntry:
        try:
            return self.models[name]
        except KeyError:
            raise EngineError(f"unknown model {name!r}; known models: {', '.join(self.models) or 'none'}") from None

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, model: str, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None, on_update=None) -> Request:
        entry = self._entry(model)
        params = params or SamplingParams()
        ids = entry.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise EngineError("the prompt is empty")
        if any((not isinstance(t, int)) or t < 0 or t >= entry.cfg.vocab_size for t in ids):
            raise EngineError(f"prompt token ids must be integers in [0, {entry.cfg.vocab_size})")
        ctx = entry.cfg.max_position
        if len(ids) + params.max_tokens > ctx:
            over = len(ids) + params.max_tokens - ctx
            raise EngineError(
                f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: together "
                f"{len(ids) + params.max_tokens}, {over} more than the context of {ctx} tokens of {model!r}")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise EngineError(f"request id {rid!r} is already in use")
        req = Request(rid, model, ids, params, on_update=on_update, decoder=IncrementalDecoder(entry.tokenizer))
        capacity = len(ids) + params.max_tokens
        try:
            self.scheduler.add_request(SchedRequest(rid, model, len(ids), params.max_tokens,
                                                    align_up(capacity * entry.cfg.kv_bytes_per_token()),
                                                    req.arrival))
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.requests[rid] = req
        return req

    def abort(self, req_id: str, reason: str = "abort", error: str | None = None) -> None:
        req = self.requests.get(req_id)
        if req is not None and not req.done:
            self._finish(req, reason, error)

    def has_work(self) -> bool:
        return bool(self.requests)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if len(req.text) > req._emitted:
            self._emit(req, len(req.text))  # flush text held back while a stop string was possible
        req.finish_reason, req.error, req.finished_at = reason, error, time.perf_counter()
        self.requests.pop(req.id, None)
        self.scheduler.finish(req.id)
        self.executor.free(req.id)
        if req.on_update:
            req.on_update(req, "")

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> None:
        """One iteration: schedule, swap, execute one batch, update requests."""
        plan = self.scheduler.schedule()
        for rid, why in plan.failed:
            if rid in self.requests:
                self._finish(self.requests[rid], "error", why)
        try:
            evict_s = self._swap(plan)
        except Exception as e:  # a swap that fails fails the step's requests, never the engine
            for name in plan.loads + plan.prefetch:  # residency follows what really happened
                self.scheduler.models[name].resident = name in self.executor.resident
            for rid in plan.prefill + plan.decode:
                self._finish(self.requests[rid], "error", f"swap failed: {type(e).__name__}: {e}")
            return
        if plan.model is None:
            return
        self.stats["steps"] += 1
        reqs = [self.requests[r] for r in plan.prefill + plan.decode]
        seqs = []
        for r in reqs:
            new = r.prompt_ids if not r.output_ids else r.output_ids[-1:]
            past = 0 if not r.output_ids else len(r.prompt_ids) + len(r.output_ids) - 1
            seqs.append(SeqInput(r.id, new, past, len(r.prompt_ids) + r.params.max_tokens, r.params))
        try:
            result = self.executor.execute(ExecuteBatch(plan.model, seqs))
        except Exception as e:  # a failed step fails its requests, never the engine
            for r in reqs:
                self._finish(r, "error", f"execution failed: {type(e).__name__}: {e}")
            return
        for m, s in result.load_s.items():
            self.stats["swap_in_seconds"] += s
            self._notify("load", m, s)
        now = time.perf_counter()
        for r in reqs:
            r.compute_s += result.compute_s
            if not r.output_ids:
                r.first_token_at, r.load_s, r.evict_s = now, result.load_s.get(r.model, 0.0), evict_s
            self._append(r, result.tokens[r.id])
        self.scheduler.update(plan, [])

    def _swap(self, plan) -> float:
        """Apply a plan's evictions, then its loads (asynchronous copies); returns eviction seconds."""
        evict_s = 0.0
        for m in plan.evictions:
            evict_s += self._evict(m)
        for m in plan.loads + plan.prefetch:
            self.executor.load(m)
            self.stats["swap_ins"] += 1
            self.stats["swap_in_bytes"] += self.models[m].nbytes
        return evict_s

    def _evict(self, name: str) -> float:
        s = self.executor.evict(name)
        self.stats["evictions"] += 1
        self._notify("evict", name, s)
        return s

    def _notify(self, kind: str, model: str, seconds: float) -> None:
        for fn in self.listeners:
            fn(kind, model, seconds, self.models[model].nbytes)

    def _append(self, r: Request, token: int) -> None:
        """Add one generated token: detokenise incrementally, then end on EOS, a stop string or
        max_tokens; report new text, holding back a tail that could still grow into a stop string."""
        if token == self.models[r.model].tokenizer.eos_token_id and not r.params.ignore_eos:
            r.text += r.decoder.flush()
            self._finish(r, "stop")
            return
        r.output_ids.append(token)
        old = len(r.text)
        r.text += r.decoder.push(token)
        full = len(r.output_ids) >= r.params.max_tokens
        if full:
            r.text += r.decoder.flush()
        hits = [at for s in r.params.stop if (at := r.text.find(s, max(0, old - len(s) + 1))) >= 0]
        if hits:
            r.text = r.text[: min(hits)]
            self._finish(r, "stop")
            return
        if full:
            self._finish(r, "length")
            return
        safe = len(r.text)
        for s in r.params.stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if r.text.endswith(s[:k]):
                    safe = min(safe, len(r.text) - k)
                    break
        self._emit(r, safe)

    def _emit(self, r: Request, upto: int) -> None:
        delta = r.text[r._emitted:upto]
        r._emitted = max(r._emitted, upto)
        if r.on_update:
            r.on_update(r, delta)

    # ---- convenience -------------------------------------------------------------------------
    def run_until_done(self, reqs: list[Request], max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if all(r.done for r in reqs):
                return
            self.step()
        raise RuntimeError(f"requests not done after {max_steps} steps")

    def generate(self, model: str, prompt: str | list[int], params: SamplingParams | None = None) -> Request:
        req = self.submit(model, prompt, params)
        self.run_until_done([req])
        return req

    def memory(self) -> dict[str, int]:
        return {**self.executor.memory(), "budget": self.budget}
