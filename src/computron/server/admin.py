"""Admin routes: register, load, offload, pin, unpin and delete models at run time.

The routes are off unless the server has an admin key (``server.admin_key``); the Guard
middleware checks it. Registrations are bounded by ``server.host_memory_budget``: a model whose
estimated host image (a preset's shape, a checkpoint's safetensors files) would take the host
images past it is refused with 409 before anything is built.

A checkpoint directory registered here must lie inside one of ``server.model_dirs`` once
symlinks are resolved (403 otherwise); the resolved path is what gets loaded, so a link
swapped after the check cannot redirect it. Preset names are always allowed.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ..config import ModelSpec, format_bytes
from ..models import PRESETS, canonical_name
from ..models.config import DTYPE_BYTES, ModelConfig
from .errors import APIError, ModelNotFound
from .protocol import RegisterModelRequest, now


def _looks_like_path(source: str) -> bool:
    return (os.sep in source or "/" in source or source.startswith((".", "~"))
            or (Path(source) / "config.json").is_file())


def checked_source(source: str, model_dirs: list[str]) -> str:
    """The source to register: a preset name as is, or the resolved checkpoint directory when it
    lies inside ``model_dirs``. APIError 403/400 otherwise."""
    if not _looks_like_path(source):
        if canonical_name(source) in PRESETS:
            return canonical_name(source)
        raise APIError(400, f"unknown model source {source!r}: neither a preset ({', '.join(PRESETS)}) nor a "
                       "checkpoint directory", "source", "unknown_source")
    try:
        path = Path(source).expanduser().resolve()
        roots = [Path(d).expanduser().resolve() for d in model_dirs]
    except (OSError, RuntimeError, ValueError) as e:
        raise APIError(400, f"cannot resolve {source!r}: {e}", "source", "invalid_path") from None
    if not any(path == r or path.is_relative_to(r) for r in roots):
        where = ", ".join(str(r) for r in roots) if roots else "none are configured (server.model_dirs, --model-dir)"
        raise APIError(403, f"checkpoint {source!r} lies outside the model directories: {where}", "source",
                       "path_not_allowed")
    if not (path / "config.json").is_file():
        raise APIError(400, f"{source!r} is not a checkpoint directory (no config.json)", "source", "invalid_path")
    return str(path)


def estimate_bytes(source: str, dtype: str | None) -> int:
    """The host bytes a model will take, before it is built: a preset's parameter count times its
    weight size, or the size of a checkpoint's safetensors files (halved or doubled for a dtype
    other than the files')."""
    if canonical_name(source) in PRESETS:
        c: ModelConfig = PRESETS[canonical_name(source)]
        h, f, v = c.hidden_size, c.ffn_size, c.vocab_size
        kv = c.kv_heads * (c.head_size or h // c.num_heads)
        layer = 2 * h * h + 2 * h * kv + (3 if c.gated_mlp else 2) * h * f
        n = c.num_layers * layer + v * h * (1 if c.tie_embeddings else 2)
        n += c.max_position * h if c.position == "learned" else 0
        return n * DTYPE_BYTES[dtype or c.dtype]
    files = sum(p.stat().st_size for p in Path(source).glob("*.safetensors"))
    if dtype is None:
        return files
    with_bytes = {"float32": 4}.get(dtype, 2)
    return files * with_bytes // 2 if files else 0  # checkpoints are mostly 16-bit


def host_budget(config_bytes: int | None) -> int:
    """The configured host-memory budget, or 80% of the machine's physical memory."""
    if config_bytes is not None:
        return config_bytes
    return int(0.8 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def add_admin_routes(app: FastAPI, svc) -> None:
    ae, engine = svc.ae, svc.engine

    def known(name: str) -> None:
        if name not in engine.models:
            raise ModelNotFound(name, list(engine.models))

    async def act(name: str, fn, *args) -> dict:
        def call():
            known(name)
            try:
                fn(name, *args)
            except ValueError as e:  # busy, or does not fit next to busy/pinned models
                raise APIError(409, str(e), None, "conflict") from None
            return svc.model_info(name)

        return await ae.run(call)

    @app.post("/admin/models", status_code=201)
    async def register_model(body: RegisterModelRequest):
        source = checked_source(body.source, svc.config.server.model_dirs)
        alias = body.alias or Path(body.source.rstrip("/\\") or body.source).name
        spec = ModelSpec(source=source, alias=alias, pinned=body.pinned, dtype=body.dtype, seed=body.seed)

        taken = await ae.run(lambda: None if spec.name in engine.models else
                             sum(e.nbytes for e in engine.models.values()))
        if taken is None:
            raise APIError(409, f"a model named {spec.name!r} is already registered", "alias", "conflict")
        need, budget = estimate_bytes(source, body.dtype), host_budget(svc.config.server.host_memory_budget)
        if taken + need > budget:
            raise APIError(409, f"not enough host memory for {spec.name!r}: it needs about {format_bytes(need)}, "
                           f"the registered models hold {format_bytes(taken)} of the host-memory budget of "
                           f"{format_bytes(budget)} (server.host_memory_budget, --host-memory-budget)",
                           "source", "host_memory")
        await ae.register_model(spec)  # builds the host image off the engine thread

        def call():
            svc.created[spec.name] = now()
            if body.load:
                try:
                    engine.load(spec.name)
                except ValueError as e:
                    raise APIError(409, f"registered {spec.name!r} but could not load it: {e}", None,
                                   "conflict") from None
            return svc.model_info(spec.name)

        return JSONResponse(await ae.run(call), status_code=201)

    @app.post("/admin/models/{model_id:path}/load")
    async def load(model_id: str):
        return await act(model_id, engine.load)

    def offload_unpinned(name: str) -> None:
        if engine.model_stats(name)["pinned"]:
            raise ValueError(f"model {name!r} is pinned: unpin it before offloading it")
        engine.offload(name)

    def load_and_pin(name: str) -> None:
        """A pinned model stays on its devices: load it first (refused when it cannot fit)."""
        if engine.model_state(name) == "offloaded":
            engine.load(name)
        engine.set_pinned(name, True)

    @app.post("/admin/models/{model_id:path}/offload")
    async def offload(model_id: str):
        return await act(model_id, offload_unpinned)

    @app.post("/admin/models/{model_id:path}/pin")
    async def pin(model_id: str):
        return await act(model_id, load_and_pin)

    @app.post("/admin/models/{model_id:path}/unpin")
    async def unpin(model_id: str):
        return await act(model_id, engine.set_pinned, False)

    @app.delete("/admin/models/{model_id:path}")
    async def delete(model_id: str):
        def call():
            known(model_id)
            try:
                engine.unregister_model(model_id)
            except ValueError as e:  # requests in flight
                raise APIError(409, str(e), None, "conflict") from None

        await ae.run(call)
        svc.created.pop(model_id, None)
        return {"id": model_id, "object": "model", "deleted": True}
