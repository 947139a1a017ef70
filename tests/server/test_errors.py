"""Error statuses in the OpenAI shape (400, 401, 404, 429, 503), and clients that go away."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from computron.engine import Engine

from .conftest import engine_config, running


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err["message"]
    return err


def post(live, path: str, **kw) -> httpx.Response:
    return httpx.post(live.url + path, timeout=30, **kw)


@pytest.mark.parametrize("body, words", [
    ({"model": "tiny-opt", "prompt": "x" * 500, "max_tokens": 100}, ("501 tokens", "max_tokens is 100", "89 more than",
                                                                     "context of 512")),
    ({"model": "tiny-opt", "prompt": "hi", "temperature": -1}, ("temperature",)),
    ({"model": "tiny-opt", "prompt": "hi", "top_p": 0}, ("top_p",)),
    ({"model": "tiny-opt", "prompt": "hi", "max_tokens": 0}, ("max_tokens",)),
    ({"model": "tiny-opt", "prompt": "hi", "n": 17}, ("n", "less than or equal to 16")),
    ({"model": "tiny-opt", "prompt": "hi", "n": 2, "best_of": 1}, ("best_of (1) must be at least n (2)",)),
    ({"model": "tiny-opt", "prompt": "hi", "logit_bias": {"a": 1}}, ("logit_bias", "token ids")),
    ({"model": "tiny-opt", "prompt": "hi", "min_tokens": 9, "max_tokens": 4}, ("min_tokens (9)",)),
    ({"model": "tiny-opt", "prompt": "hi", "stop": [""]}, ("stop",)),
    ({"model": "tiny-gpt2", "prompt": ""}, ("empty",)),  # no BOS: nothing at all
    ({"model": "tiny-opt", "prompt": [1, 2, 100000]}, ("token ids",)),
    ({"model": "tiny-opt", "prompt": ["a", "b"]}, ("2 prompts",)),
    ({"model": "tiny-opt", "prompt": "hi", "seed": 2**70}, ("seed",)),
    ({"prompt": "hi"}, ("model", "Field required")),
    ({"model": "tiny-opt", "prompt": "hi", "max_tokens": "many"}, ("max_tokens",)),
    ({"model": "tiny-opt", "prompt": {"a": 1}}, ("prompt",)),
])
def test_400_completions(live, body, words):
    err = assert_error(post(live, "/v1/completions", json=body), 400, *words)
    assert err["type"] == "invalid_request_error"


def test_400_chat_and_malformed_json(live):
    assert_error(post(live, "/v1/chat/completions", json={"model": "tiny-opt", "messages": []}), 400, "messages")
    assert_error(post(live, "/v1/chat/completions", json={"model": "tiny-opt", "messages": [{"content": "x"}]}),
                 400, "role")
    err = assert_error(post(live, "/v1/completions", content=b'{"model": "tiny-opt", "prompt": ',
                            headers={"Content-Type": "application/json"}), 400)
    assert "JSON" in err["message"] or "json" in err["message"]
    assert_error(post(live, "/v1/chat/completions", json={"model": "tiny-llama", "stream": True,
                                                          "messages": [{"role": "user", "content": "hi " * 300}]}),
                 400, "tokens")


def test_400_through_the_client(live):
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny-opt", prompt="x" * 600, max_tokens=4)
    assert "more than the context" in str(e.value)


def test_404_names_known_models(live):
    err = assert_error(post(live, "/v1/completions", json={"model": "gpt-4", "prompt": "hi"}), 404,
                       "gpt-4", "tiny-opt", "tiny-llama", "tiny-gpt2")
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert_error(post(live, "/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
                 404, "tiny-opt")
    assert_error(httpx.get(live.url + "/v1/models/nope"), 404, "tiny-opt")
    assert_error(httpx.get(live.url + "/no/such/route"), 404)
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])


def test_401_api_key():
    with running(models=("tiny-opt",), api_key="s3cret") as live:
        assert httpx.get(live.url + "/health").status_code == 200  # open
        for path in ("/v1/models", "/metrics", "/openapi.json"):
            assert_error(httpx.get(live.url + path), 401, "API key")
            assert_error(httpx.get(live.url + path, headers={"Authorization": "Bearer wrong"}), 401, "wrong")
        # The API key does not open the admin routes: they are off without an admin key.
        assert_error(post(live, "/admin/models", json={"source": "tiny-gpt2"}, headers=live.headers()), 403,
                     "admin routes are off", "--admin-key")
        assert httpx.get(live.url + "/v1/models", headers=live.headers()).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=live.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model="tiny-opt", prompt="hi", max_tokens=3).usage.completion_tokens == 3


def test_429_when_the_queue_is_full():
    engine = Engine(engine_config())
    with running(models=("tiny-opt",), engine=engine, max_queue=2) as live:
        gate = threading.Event()
        step = engine.step
        # Hold the engine's steps (not its command handling): submitted requests stay queued.
        engine.step = lambda: time.sleep(0.002) if not gate.is_set() else step()
        results = []

        def send():
            results.append(httpx.post(live.url + "/v1/completions", json={"model": "tiny-opt", "prompt": "hi",
                                                                         "max_tokens": 4}, timeout=30))

        waiting = [threading.Thread(target=send) for _ in range(2)]
        for t in waiting:
            t.start()
        deadline = time.monotonic() + 10
        while live.call(lambda: engine.model_stats("tiny-opt")["waiting"]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(live.url + "/v1/completions", json={"model": "tiny-opt", "prompt": "hi"})
        err = assert_error(r, 429, "queue", "full")
        assert int(r.headers["Retry-After"]) >= 1 and err["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0).completions.create(
                model="tiny-opt", prompt="hi")
        gate.set()
        for t in waiting:
            t.join(30)
        assert [r.status_code for r in results] == [200, 200]
        assert live.metric("computron_requests_total", model="tiny-opt", endpoint="completions", status="429") == 2


def test_503_while_starting():
    engine = Engine(engine_config())
    gate = threading.Event()
    with running(models=("tiny-opt", "tiny-gpt2"), engine=engine, ready=False, hold=gate, admin_key="a") as live:
        try:
            # The server is up although registration is held back: its lifespan did not block.
            r = httpx.get(live.url + "/health")
            assert r.status_code == 503 and r.json()["status"] == "starting"
            r = post(live, "/v1/completions", json={"model": "tiny-opt", "prompt": "hi"})
            assert_error(r, 503, "starting")
            assert r.headers["Retry-After"] == "1"
            assert_error(httpx.get(live.url + "/v1/models"), 503)
            assert_error(post(live, "/admin/models/tiny-opt/load", headers={"Authorization": "Bearer a"}), 503)
            assert httpx.get(live.url + "/metrics").status_code == 200
        finally:
            gate.set()
        deadline = time.monotonic() + 30
        while httpx.get(live.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = post(live, "/v1/completions", json={"model": "tiny-opt", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_stream_disconnect_frees_the_request(live):
    before = live.metric("computron_requests_total", model="tiny-gpt2", endpoint="completions", status="499")
    body = {"model": "tiny-gpt2", "prompt": "long", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", live.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            busy = live.call(lambda: len(live.engine.requests))
            assert busy == 1 and live.call(lambda: live.engine.memory()["kv"]) > 0
        # leaving the block closes the connection mid-stream
    state = live.idle()
    assert state["requests"] == 0 and state["kv"] == 0
    assert live.metric("computron_requests_total", model="tiny-gpt2", endpoint="completions",
                       status="499") == before + 1


def test_non_stream_disconnect_frees_the_request(live):
    body = {"model": "tiny-llama", "prompt": "long", "max_tokens": 450, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.05))
    state = live.idle()
    assert state["requests"] == 0 and state["kv"] == 0
    assert live.metric("computron_requests_total", model="tiny-llama", endpoint="completions", status="499") >= 1


def test_many_streams_closed_early_free_everything(live):
    """Several clients (the official async client) each read one chunk of a long stream and go away."""
    import asyncio

    async def one(ac, model):
        stream = await ac.chat.completions.create(model=model, messages=[{"role": "user", "content": "go"}],
                                                  max_tokens=300, temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True})
        async for chunk in stream:
            assert chunk.choices[0].delta.role == "assistant"
            break
        await stream.close()

    async def main():
        async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0) as ac:
            await asyncio.gather(*(one(ac, m) for m in ("tiny-opt", "tiny-llama", "tiny-opt", "tiny-gpt2")))

    def gone() -> float:
        return sum(live.metric("computron_requests_total", model=m, endpoint="chat", status="499")
                   for m in ("tiny-opt", "tiny-llama", "tiny-gpt2"))

    before = gone()
    asyncio.run(main())
    state = live.idle()
    assert state["requests"] == 0 and state["kv"] == 0
    assert gone() == before + 4
