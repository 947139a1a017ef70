"""The OpenAI API through the official client, sync and async, streamed and not, against the engine's
own greedy output; and many concurrent requests across models under a budget that forces swaps."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest

from .conftest import MODELS


def client(live, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, **kw)


def aclient(live, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, **kw)


CHAT = (("system", "You are terse."), ("user", "Name a colour."))


def messages(chat=CHAT) -> list[dict]:
    return [{"role": r, "content": c} for r, c in chat]


@pytest.mark.parametrize("model", MODELS)
def test_completion_matches_engine(live, reference, model):
    ref = reference(model, "The quick brown fox", 12)
    r = client(live).completions.create(model=model, prompt="The quick brown fox", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == model
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_ids), len(ref.output_ids))
    assert r.usage.total_tokens == len(ref.prompt_ids) + len(ref.output_ids)


def test_completion_stream_with_usage(live, reference):
    ref = reference("tiny-llama", "Once upon a time", 20)
    chunks = list(client(live).completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=20,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.output_ids)


def test_completion_token_ids_and_stop(live, reference):
    ids = [72, 101, 108, 108, 111]  # "Hello" in the byte tokenizer
    ref = reference("tiny-gpt2", tuple(ids), 10)
    r = client(live).completions.create(model="tiny-gpt2", prompt=ids, max_tokens=10, temperature=0)
    assert r.choices[0].text == ref.text and r.usage.prompt_tokens == len(ids)
    stop = ref.text[3:5]
    if stop.strip("\ufffd"):
        ref_stop = reference("tiny-gpt2", tuple(ids), 10, stop=(stop,))
        r = client(live).completions.create(model="tiny-gpt2", prompt=ids, max_tokens=10, temperature=0, stop=[stop])
        assert r.choices[0].text == ref_stop.text and r.choices[0].finish_reason == "stop"
        assert stop not in r.choices[0].text


def test_chat_matches_engine(live, reference):
    ref = reference("tiny-opt", max_tokens=15, chat=CHAT)
    c = client(live)
    r = c.chat.completions.create(model="tiny-opt", messages=messages(), max_tokens=15, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_ids) and r.usage.completion_tokens == len(ref.output_ids)
    stream = c.chat.completions.create(model="tiny-opt", messages=messages(), max_tokens=15, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert chunks[-1].usage.total_tokens == len(ref.prompt_ids) + len(ref.output_ids)


def test_sampling_with_seed_is_reproducible(live):
    c = client(live)
    kw = dict(model="tiny-opt", prompt="abc", max_tokens=8, temperature=0.9, top_p=0.9, seed=1234)
    assert c.completions.create(**kw).choices[0].text == c.completions.create(**kw).choices[0].text


async def _one(ac: openai.AsyncOpenAI, i: int, model: str, stream: bool, chat: bool, delay: float = 0.0):
    await asyncio.sleep(delay)
    n = 6 + i % 7
    if chat:
        conv = (("user", f"request {i}"),)
        kw = dict(model=model, messages=messages(conv), max_tokens=n, temperature=0)
        if stream:
            text = "".join([ch.choices[0].delta.content or "" async for ch in
                            await ac.chat.completions.create(stream=True, **kw) if ch.choices])
        else:
            text = (await ac.chat.completions.create(**kw)).choices[0].message.content
        return dict(model=model, max_tokens=n, chat=conv), text
    prompt = f"prompt number {i}:"
    kw = dict(model=model, prompt=prompt, max_tokens=n, temperature=0)
    if stream:
        text = "".join([ch.choices[0].text async for ch in await ac.completions.create(stream=True, **kw)])
    else:
        text = (await ac.completions.create(**kw)).choices[0].text
    return dict(model=model, prompt=prompt, max_tokens=n), text


def test_concurrent_requests_across_models_swap(live, reference):
    before = live.call(lambda: dict(live.engine.stats))
    rng = random.Random(0)
    # Three rounds of 10 concurrent requests, each round to all three models in a random order:
    # as one model fits at a time, every round swaps at least twice (and bursts within a round
    # interleave the queues further).
    jobs = []
    for rnd in range(3):
        models = list(MODELS) + [MODELS[rng.randrange(3)] for _ in range(7)]
        rng.shuffle(models)
        jobs.append([(rnd * 10 + k, m, rng.random() < 0.5, rng.random() < 0.3, (k // 4) * 0.02)
                     for k, m in enumerate(models)])

    async def main():
        async with aclient(live, timeout=120) as ac:
            # Warm the client first (its first calls import modules, blocking the loop for a while).
            await _one(ac, 0, MODELS[0], True, True)
            await _one(ac, 0, MODELS[0], False, False)
            out = []
            for rnd in jobs:
                out += await asyncio.gather(*(_one(ac, *j) for j in rnd))
            return out

    results = asyncio.run(main())
    assert len(results) == 30
    for args, text in results:
        assert text == reference(**args).text, args
    after = live.call(lambda: dict(live.engine.stats))
    print("swap-ins during the test:", after["swap_ins"] - before["swap_ins"])
    assert after["swap_ins"] - before["swap_ins"] > len(MODELS)
    assert after["evictions"] > before["evictions"]
    assert live.idle()["kv"] == 0


def test_models_endpoint(live):
    data = httpx.get(live.url + "/v1/models").json()
    assert data["object"] == "list"
    by_id = {m["id"]: m for m in data["data"]}
    assert set(MODELS) <= set(by_id)
    for m in MODELS:
        info = by_id[m]
        assert info["object"] == "model" and info["owned_by"] == "computron"
        assert info["state"] in ("resident", "loading", "offloaded")
        assert info["bytes"] > 0 and info["parallel"] == {"dp": 1, "tp": 1, "pp": 1}
    # Only one tiny model fits the budget at a time.
    assert sum(by_id[m]["state"] == "resident" for m in MODELS) <= 1
    listed = client(live).models.list()
    assert {m.id for m in listed.data} >= set(MODELS)
    assert client(live).models.retrieve("tiny-opt").id == "tiny-opt"
    assert httpx.get(live.url + "/health").json()["status"] == "ok"
