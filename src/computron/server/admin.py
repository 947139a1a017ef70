"""Admin routes: register, load, offload, pin, unpin and delete models at run time.

A checkpoint directory registered here must lie inside one of ``server.model_dirs`` once
symlinks are resolved (403 otherwise); the resolved path is what gets loaded, so a link
swapped after the check cannot redirect it. Preset names are always allowed.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ..config import ModelSpec
from ..models import PRESETS
from .errors import APIError, ModelNotFound
from .protocol import RegisterModelRequest, now


def _looks_like_path(source: str) -> bool:
    return (os.sep in source or "/" in source or source.startswith((".", "~"))
            or (Path(source) / "config.json").is_file())


def checked_source(source: str, model_dirs: list[str]) -> str:
    """The source to register: a preset name as is, or the resolved checkpoint directory when it
    lies inside ``model_dirs``. APIError 403/400 otherwise."""
    if not _looks_like_path(source):
        if source in PRESETS:
            return source
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

        if await ae.run(lambda: spec.name in engine.models):
            raise APIError(409, f"a model named {spec.name!r} is already registered", "alias", "conflict")
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

    @app.post("/admin/models/{model_id:path}/offload")
    async def offload(model_id: str):
        return await act(model_id, engine.offload)

    @app.post("/admin/models/{model_id:path}/pin")
    async def pin(model_id: str):
        return await act(model_id, engine.set_pinned, True)

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
