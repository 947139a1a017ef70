"""One completion or chat completion request, from a validated body to its reply.

What flows through: the body's sampling fields → ``SamplingParams`` (checked before anything
costly) → the prompt tokenised on a worker thread, never on the engine's → ``n`` (or ``best_of``)
engine requests submitted in one call on the engine thread → text deltas pushed from the engine
thread into one asyncio queue, tagged with their choice → server-sent events, or one JSON reply
once every choice has ended.

Each choice is an engine request of its own (seeded ``seed + i`` when a seed is given, so the
choices differ yet repeat); the choices of a prompt are submitted as one group, which prefills
the prompt once and shares its cache (``EngineCore.add_group``). ``best_of`` runs that many and
returns the ``n`` with the highest sum of token log-probabilities. Log-probabilities are the
model's own (raw logits, before temperature, penalties and bias); with ``echo`` the prompt's
tokens come first, the first with none (``null``). Usage counts the prompt once and every
generated token of every choice, the discarded ``best_of`` ones included.
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import suppress

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine import SamplingParams
from . import errors, protocol
from .errors import APIError, ModelNotFound

COMPLETION_DEFAULT_MAX_TOKENS = 16  # as in the OpenAI API; chat defaults to the rest of the context


def _tokenize(tok, prompt, messages) -> list[int]:
    if messages is not None:
        prompt = tok.apply_chat_template(messages)
    return tok.encode(prompt) if isinstance(prompt, str) else list(prompt)


class Generation:
    """The engine requests of one HTTP request (one per choice), seen from the event loop."""

    def __init__(self, svc, model: str, endpoint: str):
        self.svc, self.model, self.endpoint = svc, model, endpoint
        self.reqs: list = []
        self.tokenizer = None
        self.done: set[int] = set()
        self.queue: asyncio.Queue = asyncio.Queue()  # (choice, text, done, tokens made so far)

    async def start(self, prompt, messages, max_tokens, sampling: dict, rid: str, choices: int = 1) -> None:
        """Validate the cheap things, tokenise on a worker thread (a long prompt must not stall
        other users), then submit every choice in one call on the engine thread."""
        loop, q = asyncio.get_running_loop(), self.queue
        # An atomic dict lookup from the event loop; a model entry never changes once added, and
        # the submit checks again that the model is still there.
        entry = self.svc.engine.models.get(self.model)
        if entry is None:
            raise ModelNotFound(self.model, list(self.svc.engine.models))
        SamplingParams(max_tokens=max_tokens or max(1, sampling.get("min_tokens", 0)), **sampling)  # fail early
        self.tokenizer = entry.tokenizer
        ids = await asyncio.to_thread(_tokenize, entry.tokenizer, prompt, messages)
        if max_tokens is None:
            max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if messages is None else max(1, entry.cfg.max_position - len(ids))
        seed = sampling.get("seed")
        params = [SamplingParams(max_tokens=max_tokens, **{**sampling, "seed": seed if seed is None or choices == 1
                                                           else (seed + i) % 2**64}) for i in range(choices)]

        def on_update(i: int):
            def push(req, text: str) -> None:  # engine thread
                with suppress(RuntimeError):  # the event loop is gone (server shut down)
                    loop.call_soon_threadsafe(q.put_nowait, (i, text, req.done, len(req.output_ids)))
            return push

        ae, engine = self.svc.ae, self.svc.engine
        rids = [rid if choices == 1 else f"{rid}-{i}" for i in range(choices)]
        fut = ae.call(self.svc.admit, self.model, ids, params, rids, [on_update(i) for i in range(choices)])
        try:
            self.reqs = await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:  # cancelled while being admitted: abort once they are in
            fut.add_done_callback(lambda f: f.exception() is None and [ae.call(engine.abort, r) for r in rids])
            raise

    async def next(self) -> tuple[int, str, bool, int]:
        item = await self.queue.get()
        if item[2]:
            self.done.add(item[0])
        return item

    async def collect(self) -> list[str]:
        texts = [""] * len(self.reqs)
        while len(self.done) < len(self.reqs):
            i, text, _, _ = await self.next()
            texts[i] += text
        return texts

    def close(self) -> None:
        """Abort the requests that did not end (a client that went away); record the outcome."""
        if not self.reqs:
            return
        metrics = self.svc.metrics
        for i, req in enumerate(self.reqs):
            if not req.done:
                self.svc.ae.call(self.svc.engine.abort, req.id)
            if i:  # the HTTP request is counted once, the tokens of every choice
                metrics.generation_tokens.labels(self.model).inc(len(req.output_ids))
        first = self.reqs[0]
        status = 499 if len(self.done) < len(self.reqs) else \
            (503 if first.unavailable else 500) if first.finish_reason == "error" else 200
        metrics.request_done(self.model, self.endpoint, status, first)
        self.reqs = []

    def failure(self) -> APIError | None:
        for req in self.reqs:
            if req.finish_reason == "error":
                if req.unavailable:  # capacity or a lost device: the client may retry later, or elsewhere
                    return APIError(503, f"the request could not be served: {req.error}", None, "unavailable")
                return APIError(500, f"the request failed: {req.error}", None, "generation_failed")
        return None

    def usage(self) -> dict:
        return protocol.usage(len(self.reqs[0].prompt_ids), sum(len(r.output_ids) for r in self.reqs))

    def logprobs(self, i: int, chat: bool, start: int = 0, end: int | None = None, offset: int = 0,
                 prompt: bool = False) -> dict:
        """Choice ``i``'s tokens ``start:end``, their text starting at ``offset``; with ``prompt`` (echo),
        the prompt's tokens before them, their text starting at 0."""
        req = self.reqs[i]
        end = len(req.logprobs) if end is None else end
        out = protocol.token_logprobs(self.tokenizer, list(zip(req.output_ids[start:end], req.logprobs[start:end])),
                                      chat, offset)
        if prompt and req.prompt_logprobs is not None:
            head = protocol.token_logprobs(self.tokenizer, list(zip(req.prompt_ids, req.prompt_logprobs)), chat)
            out = {k: head[k] + out[k] for k in out}
        return out


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def generate(svc, endpoint: str, body, request: Request, prompt, messages, stream_response):
    chat = endpoint == "chat"
    bad = body.unsupported()
    if bad:
        raise APIError(400, bad[1], bad[0], "unsupported")
    want = (body.top_logprobs or 0) if (body.logprobs if chat else body.logprobs is not None) else None
    n, runs = body.n, body.best_of or body.n
    # best_of ranks its choices by their log-probabilities: compute them even when not returned
    internal = want if runs == n else (want or 0)
    sampling = body.sampling(internal)
    if body.echo and want is not None:
        sampling["prompt_logprobs"] = want
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    gen = Generation(svc, body.model, endpoint)
    try:
        await gen.start(prompt, messages, body.max_new if chat else body.max_tokens, sampling, rid, runs)
    except APIError as e:
        svc.metrics.request_done(body.model if e.status != 404 else "unknown", endpoint, e.status)
        raise
    except ValueError as e:
        svc.metrics.request_done(body.model, endpoint, 400)
        msg = str(e)
        raise APIError(400, msg, errors.param_of(msg, "messages" if chat else "prompt"), "invalid_value") from None
    created = protocol.now()
    echo = ""
    if body.echo:
        echo = prompt if isinstance(prompt, str) else gen.tokenizer.decode(prompt)
    if body.stream:
        return stream_response(_events(gen, body, rid, created, chat, want, echo), gen.close)
    collect = asyncio.create_task(gen.collect())
    watch = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():  # the client went away
            return Response(status_code=499)
        texts = collect.result()
        failed = gen.failure()
        if failed is not None:
            raise failed
        order = range(runs)
        if runs > n:  # best_of: the n choices of the highest cumulative log-probability
            order = sorted(order, key=lambda i: -sum(lp for lp, _ in gen.reqs[i].logprobs))[:n]
        choices = [protocol.choice(k, echo + texts[i], protocol.FINISH[gen.reqs[i].finish_reason], chat,
                                   logprobs=gen.logprobs(i, chat, offset=len(echo), prompt=body.echo)
                                   if want is not None else None)
                   for k, i in enumerate(order)]
        return JSONResponse({**protocol.reply(rid, body.model, created, choices, chat), "usage": gen.usage()})
    finally:
        for t in (collect, watch):
            t.cancel()
        gen.close()


async def _events(gen: Generation, body, rid: str, created: int, chat: bool, want: int | None, echo: str):
    model, sse, n = body.model, protocol.sse, len(gen.reqs)
    extra = {"usage": None} if body.include_usage else {}
    sent = [0] * n  # tokens whose log-probabilities went out, per choice
    offset = [0] * n  # characters sent, per choice (completions' text_offset)

    def chunk(i: int, text: str | None, finish: str | None = None, upto: int | None = None, delta=None,
              prompt: bool = False) -> bytes:
        lp = None
        if want is not None and delta is None:
            end = len(gen.reqs[i].logprobs) if upto is None else min(upto, len(gen.reqs[i].logprobs))
            lp, sent[i] = gen.logprobs(i, chat, sent[i], end, offset[i], prompt), end
        offset[i] += len(text or "")
        c = protocol.choice(i, text, finish, chat, chunk=True, logprobs=lp, delta=delta)
        return sse({**protocol.reply(rid, model, created, [c], chat, chunk=True), **extra})

    # echo with logprobs: the prompt's come with the prefill, so its chunk waits for the choice's first news
    echoes = set(range(n)) if echo and want is not None else set()
    try:
        for i in range(n):
            if chat:
                yield chunk(i, None, delta={"role": "assistant", "content": ""})
            elif echo and not echoes:
                yield chunk(i, echo, upto=0)
        shown = [0] * n  # tokens of each choice a chunk has reported
        while len(gen.done) < n:
            i, text, _, made = await gen.next()
            if i in echoes:
                echoes.discard(i)
                yield chunk(i, echo, upto=0, prompt=True)
            if text or made > shown[i]:  # a chunk per step with a new token, even one with no text yet,
                shown[i] = made  # so that a client sees when each token came (time to first token)
                yield chunk(i, text, upto=made)
        failed = gen.failure()
        if failed is not None:
            yield sse(protocol.error_body(failed.message, "server_error", None, failed.code))
        else:
            for i, req in enumerate(gen.reqs):
                yield chunk(i, None, protocol.FINISH[req.finish_reason])
        if body.include_usage:
            yield sse({**protocol.reply(rid, model, created, [], chat, chunk=True), "usage": gen.usage()})
        yield sse("[DONE]")
    finally:
        gen.close()
