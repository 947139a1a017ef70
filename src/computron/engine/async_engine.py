"""AsyncEngine: the engine loop on a background thread, driven from asyncio.

The loop thread owns the engine: every call from the event loop becomes a command queued to
that thread and applied between steps, so no engine state is touched by two threads. Token
deltas flow back through ``loop.call_soon_threadsafe`` into one asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from .engine import Engine, Request
from ..messages import SamplingParams

log = logging.getLogger("computron.engine")


@dataclass
class Delta:
    text: str
    request: Request
    done: bool


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._cmds: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="computron-engine", daemon=True)
        self._thread.start()

    # ---- the loop thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_work()
            try:
                while True:
                    fn, fut = self._cmds.get(block=block, timeout=0.05 if block else None)
                    block = False
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn())
                        except BaseException as e:  # handed to the caller, never kills the loop
                            fut.set_exception(e)
            except queue.Empty:
                pass
            if self.engine.has_work():
                try:
                    stats, t0 = self.engine.stats, time.perf_counter()
                    ran = stats["steps"]
                    self.engine.step()
                    if stats["steps"] != ran:  # the wall time of steps that ran: host work and the device's
                        stats["step_seconds"] = stats.get("step_seconds", 0.0) + time.perf_counter() - t0
                except Exception as e:  # last line of defence: answer everything, keep the loop alive
                    log.exception("engine step failed")
                    for rid in list(self.engine.requests):
                        self.engine.abort(rid, "error", f"engine step failed: {type(e).__name__}: {e}")

    def call(self, fn: Callable, *args, **kwargs) -> Future:
        """Run ``fn(*args)`` on the engine thread between steps; a concurrent Future of its result."""
        fut: Future = Future()
        self._cmds.put((lambda: fn(*args, **kwargs), fut))
        return fut

    async def run(self, fn: Callable, *args, **kwargs):
        return await asyncio.wrap_future(self.call(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # ---- asyncio API -------------------------------------------------------------------------
    async def register_model(self, spec, progress: Callable[[str], None] | None = None):
        """Register a model without stalling the engine: its host image is built on a worker
        thread while requests keep being served; only the final hand-over runs between steps."""
        prepared = await asyncio.to_thread(self.engine.build_model, spec, progress)
        return await self.run(self.engine.add_model, prepared)

    async def stream(self, model: str, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[Delta]:
        """Yield text deltas as tokens arrive; the last Delta has ``done=True``. Cancelling the
        consumer (a client that went away) aborts the request and frees its cache."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def on_update(req: Request, text: str) -> None:
            loop.call_soon_threadsafe(q.put_nowait, Delta(text, req, req.done))

        req = await self.run(self.engine.submit, model, prompt, params, request_id, on_update)
        try:
            while True:
                d = await q.get()
                yield d
                if d.done:
                    return
        finally:
            if not req.done:
                self.call(self.engine.abort, req.id)

    async def generate(self, model: str, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> Request:
        async for d in self.stream(model, prompt, params, request_id):
            if d.done:
                return d.request
        raise RuntimeError("stream ended without a final delta")
