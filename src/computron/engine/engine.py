"""Engine: text on top of the engine core (tokenizers, incremental detokenising, stop strings).

Lives on the host and imports no torch. Text comes in and is tokenised here; token ids go to
the ``EngineCore``, which schedules them onto its executor (chosen from the config, or injected);
tokens come back and are detokenised here. Every request submitted ends with exactly one of:
finished (``finish_reason`` stop/length), failed (``error``), or aborted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ..config import EngineConfig, ModelSpec
from ..messages import ModelDescription, ModelInfo, SamplingParams
from ..models import CheckpointError, IncrementalDecoder, load_tokenizer
from ..scheduler import StepPlan
from .core import CoreRequest, EngineCore, EngineError
from .executor import Executor, make_executor


@dataclass(eq=False)
class Request(CoreRequest):
    text: str = ""
    # Called as (request, new text) after every generated token (the text may be "" while a
    # character or a possible stop string is incomplete) and once more when the request ends.
    on_update: Callable[["Request", str], None] | None = None
    decoder: IncrementalDecoder | None = None
    _emitted: int = 0  # chars of text already reported


@dataclass
class ModelEntry:
    name: str
    source: str
    info: ModelInfo
    tokenizer: object

    @property
    def cfg(self):
        return self.info.config

    @property
    def nbytes(self) -> int:
        return self.info.total_bytes


@dataclass
class PreparedModel:
    """A model whose host image is built by the executor, not yet known to the scheduler."""

    spec: ModelSpec
    entry: ModelEntry


class Engine:
    def __init__(self, config: EngineConfig | None = None, executor: Executor | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.config = cfg = config or EngineConfig()
        try:
            self.executor = executor or make_executor(cfg)
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.core = EngineCore(self.executor, cfg, clock)
        self.core.on_token, self.core.on_finish = self._on_token, self._on_finish
        self.clock = clock
        self.models: dict[str, ModelEntry] = {}

    @property
    def requests(self) -> dict[str, CoreRequest]:
        return self.core.requests

    @property
    def stats(self) -> dict:
        return self.core.stats

    @property
    def listeners(self) -> list:
        return self.core.listeners

    # ---- models --------------------------------------------------------------------------------
    def register_model(self, spec: ModelSpec | str, progress: Callable[[str], None] | None = None) -> ModelEntry:
        """Build a model's host image and add it; see ``build_model`` and ``add_model``."""
        return self.add_model(self.build_model(spec, progress))

    def build_model(self, spec: ModelSpec | str, progress: Callable[[str], None] | None = None) -> PreparedModel:
        """The slow half of registration: the executor builds and fills the host image.

        Touches no engine state, so it may run on another thread while the engine keeps serving
        (the server registers models at run time this way)."""
        spec = ModelSpec.parse(spec) if isinstance(spec, str) else spec
        if spec.name in self.models:
            raise EngineError(f"a model named {spec.name!r} is already registered")
        try:
            desc = ModelDescription(spec.name, spec.source, spec.dtype, spec.seed, spec.placement())
        except ValueError as e:
            raise EngineError(f"model {spec.name!r}: {e}") from None
        try:
            info = self.executor.register(desc, progress)
        except (KeyError, ValueError, FileNotFoundError) as e:
            if isinstance(e, (EngineError, CheckpointError)):
                raise
            raise EngineError(str(e.args[0]) if e.args else str(e)) from None
        try:
            tokenizer = load_tokenizer(info.checkpoint, info.config)
        except BaseException:
            self.executor.unregister(spec.name)
            raise
        return PreparedModel(spec, ModelEntry(spec.name, spec.source, info, tokenizer))

    def add_model(self, prepared: PreparedModel) -> ModelEntry:
        """The quick half of registration (on the engine's thread): make a built model servable."""
        entry = prepared.entry
        self.core.add_model(entry.info, pinned=prepared.spec.pinned)
        self.models[entry.name] = entry
        return entry

    def unregister_model(self, name: str) -> None:
        self.core.remove_model(name)
        del self.models[name]

    def model_state(self, name: str) -> str:
        return self.core.model_state(name)

    def model_stats(self, name: str) -> dict:
        """Queue, batch, residency and placement of one model (what /v1/models and metrics show)."""
        info = self.core.info(name)
        return {**self.core.model_stats(name), "parallel": {"dp": info.placement.dims.dp,
                "tp": info.placement.dims.tp, "pp": info.placement.dims.pp}}

    def load(self, name: str, wait: bool = False) -> None:
        self.core.load(name, wait)

    def offload(self, name: str) -> None:
        self.core.offload(name)

    def set_pinned(self, name: str, pinned: bool) -> None:
        self.core.set_pinned(name, pinned)

    def _entry(self, name: str) -> ModelEntry:
        self.core.info(name)
        return self.models[name]

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, model: str, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None, on_update=None) -> Request:
        return self.core.add_request(self._request(model, prompt, params, request_id, on_update))

    def submit_choices(self, model: str, prompt: str | list[int], params: list[SamplingParams],
                       request_ids: list[str | None] | None = None, on_updates: list | None = None) -> list[Request]:
        """Several choices of one prompt (``n``, ``best_of``): queued together, all or none; the
        prompt is prefilled once and its cache shared (``EngineCore.add_group``)."""
        rids, fns = request_ids or [None] * len(params), on_updates or [None] * len(params)
        if len(params) == 1:
            return [self.submit(model, prompt, params[0], rids[0], fns[0])]
        ids = self._entry(model).tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self.core.add_group([self._request(model, ids, p, rid, fn) for p, rid, fn in zip(params, rids, fns)])

    def _request(self, model: str, prompt: str | list[int], params: SamplingParams | None, request_id: str | None,
                 on_update) -> Request:
        entry = self._entry(model)
        ids = entry.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return Request(request_id or self.core.new_id(), model, ids, params or SamplingParams(), arrival=self.clock(),
                       on_update=on_update, decoder=IncrementalDecoder(entry.tokenizer))

    def abort(self, req_id: str, reason: str = "abort", error: str | None = None) -> None:
        self.core.abort(req_id, reason, error)

    def has_work(self) -> bool:
        return self.core.has_work()

    def step(self) -> StepPlan:
        """One scheduling step; a steady decode batch may run ``config.decode_steps`` steps in it.
        Returns what the scheduler planned for it."""
        return self.core.step(self.config.decode_steps)

    # ---- text ----------------------------------------------------------------------------------
    def _on_token(self, r: Request, token: int) -> None:
        """Detokenise one new token; end on a stop string; report new text, holding back a tail
        that could still grow into a stop string."""
        old = len(r.text)
        r.text += r.decoder.push(token)
        full = len(r.output_ids) >= r.params.max_tokens
        if full:
            r.text += r.decoder.flush()
        hits = [at for s in r.params.stop if (at := r.text.find(s, max(0, old - len(s) + 1))) >= 0]
        if hits:
            r.text, r.decoder = r.text[: min(hits)], None  # nothing after a stop string is shown
            self.core.finish(r, "stop")
            return
        if full:
            return  # the core ends it ("length"), and _on_finish reports the rest
        safe = len(r.text)
        for s in r.params.stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if r.text.endswith(s[:k]):
                    safe = min(safe, len(r.text) - k)
                    break
        self._emit(r, safe)

    def _on_finish(self, r: Request) -> None:
        if r.finish_reason == "stop" and r.decoder is not None:
            r.text += r.decoder.flush()  # EOS: characters still incomplete come out now
        if len(r.text) > r._emitted:
            self._emit(r, len(r.text))  # flush text held back while a stop string was possible
        if r.on_update:
            r.on_update(r, "")

    def _emit(self, r: Request, upto: int) -> None:
        delta = r.text[r._emitted:upto]
        r._emitted = max(r._emitted, upto)
        if r.on_update:
            r.on_update(r, delta)

    # ---- convenience ---------------------------------------------------------------------------
    def run_until_done(self, reqs: list[CoreRequest], max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if all(r.done for r in reqs):
                return
            self.step()
        raise RuntimeError(f"requests not done after {max_steps} steps")

    def generate(self, model: str, prompt: str | list[int], params: SamplingParams | None = None) -> Request:
        req = self.submit(model, prompt, params)
        self.run_until_done([req])
        return req

    def memory(self) -> dict:
        return self.core.memory()
