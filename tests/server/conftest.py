"""Fixtures of the server tests: a real uvicorn server on a free loopback port, on a background thread.

What flows through: an Engine on the CPU with the tiny presets under a budget that holds one of
them at a time (so requests to different models swap) → AsyncEngine → create_app → uvicorn.
References come from a separate Engine running ``generate`` directly: same presets and seeds,
hence the same weights, and greedy decoding, hence the same tokens.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import httpx
import pytest

from computron.config import ComputronConfig, EngineConfig, ModelSpec, ServerConfig
from computron.engine import AsyncEngine, Engine, SamplingParams
from computron.server import create_app
from computron.server.background import ServerThread
from computron.server.cli import DEFAULT_BUDGET, DEFAULT_WORKSPACE

MODELS = ("tiny-opt", "tiny-llama", "tiny-gpt2")


def engine_config() -> EngineConfig:
    return EngineConfig(device="cpu", gpu_memory_budget=DEFAULT_BUDGET, workspace_bytes=DEFAULT_WORKSPACE)


@dataclass
class Live:
    url: str
    engine: Engine
    ae: AsyncEngine
    app: object
    server: ServerThread

    def call(self, fn, *args):
        """Run ``fn`` on the engine thread (the engine is not thread-safe) and return its result."""
        return self.ae.call(fn, *args).result(timeout=30)

    def idle(self, timeout: float = 10.0) -> dict:
        """Wait until the engine holds no request; its memory() then."""
        deadline = time.monotonic() + timeout
        while True:
            busy, mem = self.call(lambda: (len(self.engine.requests), self.engine.memory()))
            if not busy or time.monotonic() > deadline:
                return {"requests": busy, **mem}
            time.sleep(0.02)

    def metric(self, name: str, **labels) -> float:
        """The value of one sample of /metrics (0 when absent)."""
        text = httpx.get(self.url + "/metrics", headers=self.headers()).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            if key == (f"{name}{{{want}}}" if labels else name):
                return float(value)
        return 0.0

    def headers(self) -> dict:
        key = self.app.state.service.config.server.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


def wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/health").status_code != 200:
        if time.monotonic() > deadline:
            raise TimeoutError("server not ready")
        time.sleep(0.02)


@contextmanager
def running(models=MODELS, ready: bool = True, engine: Engine | None = None, hold=None, **server):
    """A live server on a fresh engine (or ``engine``); ``server`` sets ServerConfig fields.
    With ``hold`` (a threading.Event) the engine thread waits for it before anything else, so
    the server starts while model registration cannot run."""
    engine = engine or Engine(engine_config())
    ae = AsyncEngine(engine)
    if hold is not None:
        ae.call(hold.wait, 60)
    cfg = ComputronConfig(server=ServerConfig(**server), models=[ModelSpec(m) for m in models])
    app = create_app(ae, cfg)
    thread = ServerThread(app)
    try:
        thread.start()
        if ready:
            wait_ready(thread.url)
        yield Live(thread.url, engine, ae, app, thread)
    finally:
        thread.stop()
        ae.shutdown()


@pytest.fixture(scope="session")
def live():
    with running() as s:
        yield s


@pytest.fixture(scope="session")
def reference():
    """reference(model, prompt, max_tokens, messages=None) -> Request, from a separate Engine."""
    engine = Engine(EngineConfig(device="cpu"))
    for m in MODELS:
        engine.register_model(ModelSpec(m))

    @lru_cache(maxsize=None)
    def run(model: str, prompt: str | tuple = "", max_tokens: int = 16, chat: tuple | None = None, stop=()):
        if chat is not None:
            prompt = engine.models[model].tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in chat])
        prompt = list(prompt) if isinstance(prompt, tuple) else prompt
        return engine.generate(model, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop))

    return run
