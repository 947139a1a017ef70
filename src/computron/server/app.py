"""The HTTP server: an OpenAI-compatible API in front of one AsyncEngine.

What flows through: a JSON body (its size checked before it is parsed) → a validated pydantic
request → ``generate.py`` (tokenised on a worker thread, submitted on the engine thread) → text
deltas pushed from the engine thread into an asyncio queue → server-sent events or one JSON reply.

Every engine access goes through ``AsyncEngine.run``/``call`` (the engine is not thread-safe),
except the lookup of a model's tokenizer (an atomic read of a dict whose entries never change).
The lifespan starts model registration in the background and returns at once; until it is
done every /v1 and /admin route answers 503. A client that goes away (stream or not) aborts
its request, which frees its KV cache.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager, suppress

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..config import ComputronConfig, ModelSpec
from ..engine import AsyncEngine, SamplingParams
from . import errors, protocol
from .errors import ModelNotFound, QueueFull, error_response
from .generate import generate
from .metrics import Metrics, engine_snapshot
from .protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("computron.server")


class Service:
    """Per-app state and the engine-side half of every request."""

    def __init__(self, ae: AsyncEngine, config: ComputronConfig):
        self.ae, self.engine, self.config = ae, ae.engine, config
        self.metrics = Metrics()
        self.ready = False
        self.registered = 0
        self.pending: list[str] = [s.name for s in config.models]
        self.failed: dict[str, str] = {}
        self.started = protocol.now()
        self.created: dict[str, int] = {}
        self.task: asyncio.Task | None = None

    # ---- start-up ----------------------------------------------------------------------------
    async def register_all(self, specs: list[ModelSpec]) -> None:
        t0 = time.perf_counter()
        for i, spec in enumerate(specs, 1):
            log.info("registering model %d of %d: %s (%s)", i, len(specs), spec.name, spec.source)
            try:
                entry = await self.ae.register_model(spec, lambda msg: log.info("  %s", msg))
                self.created[entry.name] = protocol.now()
                self.registered += 1
            except Exception as e:  # one bad model must not keep the others from being served
                self.failed[spec.name] = str(e)
                log.error("could not register %s: %s", spec.name, e)
            self.pending.remove(spec.name)
        self.ready = True
        self.metrics.ready.set(1)
        if specs:
            log.info("ready in %.1f s: %d model(s) registered%s", time.perf_counter() - t0, self.registered,
                     f", {len(self.failed)} failed" if self.failed else "")

    # ---- engine thread -----------------------------------------------------------------------
    def admit(self, model: str, ids: list[int], params: list[SamplingParams], rids: list[str], on_updates: list):
        """Check the queue and submit the choices (a request each, sharing the prompt's prefill): one
        call on the engine thread, so the queue check and the submits cannot interleave with other
        requests. The prompt comes tokenised."""
        eng = self.engine
        if model not in eng.models:  # deleted while its prompt was being tokenised
            raise ModelNotFound(model, list(eng.models))
        waiting = eng.model_stats(model)["waiting"]
        if waiting >= self.config.server.max_queue:
            raise QueueFull(model, waiting)
        return eng.submit_choices(model, ids, params, rids, on_updates)

    def model_info(self, name: str) -> dict:
        """GET /v1/models entry (engine thread)."""
        eng = self.engine
        entry, st = eng.models[name], eng.model_stats(name)
        return {"id": name, "object": "model", "created": self.created.get(name, self.started), "owned_by": "computron",
                "state": st["state"], "bytes": entry.nbytes, "pinned": st["pinned"], "source": entry.source,
                "max_model_len": entry.cfg.max_position, "dtype": entry.cfg.dtype, "queue": st["waiting"],
                "running": st["running"], "parallel": st["parallel"], "devices": st["devices"]}

    def models_list(self) -> dict:
        return {"object": "list", "data": [self.model_info(n) for n in self.engine.models],
                "memory": self.engine.memory()}


class EventStream(StreamingResponse):
    """Server-sent events that stop as soon as the client disconnects, whatever ASGI spec version
    the server speaks, and then close the producer (aborting its request) right away rather than
    whenever the abandoned generator is collected."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    with suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with suppress(Exception):
                await self.body_iterator.aclose()
            self.on_close()


class Guard:
    """ASGI middleware, run before any parsing: the keys (the API key on all but /health, the admin
    key on /admin, which is off without one), 503 for /v1 and /admin while starting, and the body
    limit (413 as soon as a body grows past ``server.max_body_bytes``, before it is parsed)."""

    OPEN = ("/health",)

    def __init__(self, app, svc: Service):
        self.app, self.svc = app, svc
        srv = svc.config.server
        self.key = f"Bearer {srv.api_key}".encode() if srv.api_key else None
        self.admin_key = f"Bearer {srv.admin_key}".encode() if srv.admin_key else None
        self.max_body = srv.max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            resp = self._refuse(scope)
            if resp is None and scope["method"] in ("POST", "PUT", "PATCH"):
                resp, receive = await self._read_body(scope, receive)
            if resp is not None:
                return await resp(scope, receive, send)
        await self.app(scope, receive, send)

    def _refuse(self, scope) -> JSONResponse | None:
        path = scope["path"]
        admin = path == "/admin" or path.startswith("/admin/")
        key = self.admin_key if admin else self.key
        if admin and key is None:
            return error_response(403, "the admin routes are off: start the server with --admin-key "
                                       "(or $COMPUTRON_ADMIN_KEY) and send it as 'Authorization: Bearer <key>'",
                                  None, "admin_disabled")
        if key is not None and path not in self.OPEN:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, key):
                msg = "a wrong" if given else "no"
                return error_response(401, f"{msg} {'admin' if admin else 'API'} key: send the header "
                                           "'Authorization: Bearer <key>'", None, "invalid_api_key",
                                      {"WWW-Authenticate": "Bearer"})
        if not self.svc.ready and path.startswith(("/v1/", "/admin/")):
            done = self.svc.registered + len(self.svc.failed)
            return error_response(503, f"the server is starting: registered {done} of "
                                  f"{done + len(self.svc.pending)} models", None, "starting", {"Retry-After": "1"})
        return None

    async def _read_body(self, scope, receive):
        """The whole body, read here so that an oversized one is refused after ``max_body`` bytes
        (whatever Content-Length claims); then a ``receive`` that replays it to the app."""
        def too_large(n: str) -> JSONResponse:
            return error_response(413, f"the request body has {n} bytes, more than the limit of {self.max_body} "
                                       "(server.max_body_bytes, --max-body)", None, "body_too_large")

        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body:
            return too_large(declared.decode()), receive
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return Response(status_code=499), receive
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return too_large(f"over {size}"), receive
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would

        return None, replay


def create_app(async_engine: AsyncEngine, config: ComputronConfig | None = None, colocation=None) -> FastAPI:
    """The server app for ``async_engine``; registers ``config.models`` in the background on start-up.
    ``colocation``: the ``colocate.serving.Colocated`` of ``serve --colocate`` (its routes are added).

    The caller owns the AsyncEngine (and shuts it down after the server stops)."""
    config = config or ComputronConfig()
    svc = Service(async_engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Not awaited: start-up must not wait for a busy engine thread.
        async_engine.call(async_engine.engine.listeners.append, svc.metrics.on_swap)
        svc.task = asyncio.create_task(svc.register_all(list(config.models)))
        try:
            yield
        finally:
            svc.task.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await svc.task
            async_engine.call(_remove, async_engine.engine.listeners, svc.metrics.on_swap)

    app = FastAPI(title="Computron", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API serving many models on shared GPUs")
    app.state.service = svc
    errors.install(app)
    app.add_middleware(Guard, svc=svc)

    @app.get("/health")
    async def health():
        # The engine's own count: models registered or deleted through /admin count too.
        body = {"status": "ok" if svc.ready else "starting", "models": len(async_engine.engine.models),
                "pending": svc.pending, "failed": svc.failed}
        return JSONResponse(body, status_code=200 if svc.ready else 503)

    @app.get("/metrics", response_class=Response)
    async def metrics():
        if svc.ready:  # while starting the engine thread may be busy for long: serve what we have
            svc.metrics.update(await async_engine.run(engine_snapshot, async_engine.engine))
        return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models():
        return await async_engine.run(svc.models_list)

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        return await async_engine.run(_info_or_404, svc, model_id)

    def stream(events, on_close) -> EventStream:
        return EventStream(events, on_close, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await generate(svc, "completions", body, request, body.single_prompt(), None, stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await generate(svc, "chat", body, request, None, [m.as_dict() for m in body.messages], stream)

    from .admin import add_admin_routes

    add_admin_routes(app, svc)
    if colocation is not None:
        from ..colocate.serving import add_routes

        add_routes(app, colocation)
    errors.document(app)
    return app


def _remove(items: list, item) -> None:
    with suppress(ValueError):
        items.remove(item)


def _info_or_404(svc: Service, name: str) -> dict:
    if name not in svc.engine.models:
        raise ModelNotFound(name, list(svc.engine.models))
    return svc.model_info(name)
