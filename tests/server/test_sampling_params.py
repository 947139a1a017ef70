"""The OpenAI sampling parameters beyond the basics, through the official client: logprobs (checked
against ``transformers`` on a checkpoint written here), n and best_of, echo, logit_bias, min_tokens,
the repetition penalty (against ``transformers``' greedy generate) and the presence and frequency
penalties (against the formula), streamed and not, with usage counted over every choice."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from computron.engine.sampling import History, process
from computron.messages import SamplingParams

from .conftest import running
from .test_admin_metrics import tiny_checkpoint

PROMPT = "hello there"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """tiny-llama served from a checkpoint directory, and the same checkpoint in transformers."""
    transformers = pytest.importorskip("transformers")
    path = tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "tiny-llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with running(models=(str(path),)) as live:
        live.hf, live.name = hf, "llama"
        live.client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        live.tok = live.engine.models["llama"].tokenizer
        yield live


def hf_logprobs(hf, ids: list[int], n_prompt: int) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for the generated positions, in transformers."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    lp = logits.log_softmax(-1)
    return torch.stack([lp[i - 1, ids[i]] for i in range(n_prompt, len(ids))])


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of ``prompt`` and the log-probability of each of its tokens."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):], hf_logprobs(hf, ids, len(prompt))


def test_completion_logprobs_match_transformers(served):
    prompt = served.tok.encode(PROMPT)
    r = served.client.completions.create(model="llama", prompt=prompt, max_tokens=8, temperature=0, logprobs=3,
                                         extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens == 8
    ids, want = hf_greedy(served.hf, prompt, 8)
    assert r.choices[0].text == served.tok.decode(ids)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), want, atol=1e-4, rtol=1e-4)
    # the chosen (greedy) token is the most likely one; at most 3 alternatives, by decoded text
    assert all(abs(max(top.values()) - chosen) < 1e-6 for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.tokens == [served.tok.decode([i]) for i in ids]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(8)]


def test_chat_logprobs_match_transformers(served):
    r = served.client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                              extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    prompt = served.tok.encode(served.tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    out = [c.top_logprobs[0] for c in content]
    assert all(c.logprob == t.logprob for c, t in zip(content, out))  # greedy: the chosen token is the top one
    ids, want = hf_greedy(served.hf, prompt, 6)
    assert r.choices[0].message.content == served.tok.decode(ids)
    assert [bytes(c.bytes) for c in content] == [served.tok.token_bytes([i]) for i in ids]
    got = torch.tensor([c.logprob for c in content])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


def test_n_best_of_echo_and_usage(served):
    c = served.client
    three = c.completions.create(model="llama", prompt=PROMPT, max_tokens=5, n=3, seed=7, logprobs=0,
                                 extra_body={"ignore_eos": True})
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    assert len({ch.text for ch in three.choices}) > 1  # seeded seed, seed+1, seed+2: different draws
    assert three.usage.completion_tokens == 15 and three.usage.prompt_tokens == len(served.tok.encode(PROMPT))
    again = c.completions.create(model="llama", prompt=PROMPT, max_tokens=5, n=3, seed=7, logprobs=0,
                                 extra_body={"ignore_eos": True})
    assert [ch.text for ch in again.choices] == [ch.text for ch in three.choices]
    best = c.completions.create(model="llama", prompt=PROMPT, max_tokens=5, n=1, best_of=3, seed=7,
                                extra_body={"ignore_eos": True})
    sums = [sum(ch.logprobs.token_logprobs) for ch in three.choices]
    assert best.choices[0].text == three.choices[sums.index(max(sums))].text
    assert best.choices[0].logprobs is None and best.usage.completion_tokens == 15
    echo = c.completions.create(model="llama", prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    plain = c.completions.create(model="llama", prompt=PROMPT, max_tokens=3, temperature=0)
    assert echo.choices[0].text == PROMPT + plain.choices[0].text


def test_streamed_choices_and_logprobs_equal_the_reply(served):
    body = {"model": "llama", "prompt": PROMPT, "max_tokens": 6, "n": 2, "seed": 3, "logprobs": 1,
            "ignore_eos": True}
    whole = httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()
    texts, lps, usage = ["", ""], [[], []], None
    with httpx.stream("POST", served.url + "/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk["choices"]:
                texts[ch["index"]] += ch["text"]
                if ch["logprobs"]:
                    lps[ch["index"]] += ch["logprobs"]["token_logprobs"]
    for i in range(2):
        assert texts[i] == whole["choices"][i]["text"]
        assert lps[i] == whole["choices"][i]["logprobs"]["token_logprobs"]
    assert usage == whole["usage"] and usage["completion_tokens"] == 12


def test_logit_bias_and_min_tokens(served):
    c = served.client
    a = ord("A")
    r = c.completions.create(model="llama", prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={str(a): 100})
    assert r.choices[0].text == "AAAAA"
    eos = served.tok.eos_token_id
    r = c.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={str(eos): 100})
    assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={str(eos): 100},
                             extra_body={"min_tokens": 3})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "stop"


def test_repetition_penalty_matches_transformers(served):
    prompt = served.tok.encode(PROMPT)
    r = httpx.post(served.url + "/v1/completions", json={"model": "llama", "prompt": prompt, "max_tokens": 24,
                                                         "temperature": 0, "repetition_penalty": 8.0,
                                                         "ignore_eos": True, "logprobs": 0}).json()
    with torch.no_grad():
        want = served.hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, repetition_penalty=8.0,
                                  pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    assert want != hf_greedy(served.hf, prompt, 24)[0]  # the penalty changes the greedy choice here
    # the same ids: the same text, and each token's (raw) log-probability at transformers' ids
    assert r["choices"][0]["text"] == served.tok.decode(want)
    torch.testing.assert_close(torch.tensor(r["choices"][0]["logprobs"]["token_logprobs"]),
                               hf_logprobs(served.hf, prompt + want, len(prompt)), atol=1e-4, rtol=1e-4)


def test_presence_and_frequency_penalties_follow_the_formula():
    torch.manual_seed(0)
    logits = torch.randn(3, 300)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams(),
              SamplingParams(logit_bias={7: -3.0, 9: 2.0})]
    h = History([1, 2], 300, "cpu", True)
    for t in (5, 5, 6):
        h.add(t)
    got = process(logits, params, [h, None, None], eos=None)
    want = logits.clone()
    want[0, 5] -= 0.5 + 2 * 0.25
    want[0, 6] -= 0.5 + 0.25
    want[2, 7] -= 3.0
    want[2, 9] += 2.0
    torch.testing.assert_close(got, want)


LONG = "hello there, " * 4  # longer than a KV block: its choices share whole blocks


def test_echo_with_logprobs_scores_the_prompt_like_transformers(served):
    prompt = served.tok.encode(LONG)
    r = served.client.completions.create(model="llama", prompt=LONG, max_tokens=5, temperature=0, logprobs=2,
                                         echo=True, extra_body={"ignore_eos": True})
    lp, P = r.choices[0].logprobs, len(prompt)
    assert r.usage.prompt_tokens == P and r.usage.completion_tokens == 5
    ids, _ = hf_greedy(served.hf, prompt, 5)
    assert r.choices[0].text == LONG + served.tok.decode(ids)
    assert lp.tokens == [served.tok.decode([i]) for i in prompt + ids]
    # OpenAI's shape: nothing for the first prompt token, then log p(token | those before) for the rest
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), hf_logprobs(served.hf, prompt + ids, 1),
                               atol=1e-4, rtol=1e-4)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset[:P] == [sum(len(t) for t in lp.tokens[:k]) for k in range(P)]
    assert lp.text_offset[P:] == [len(LONG) + sum(len(t) for t in lp.tokens[P:P + k]) for k in range(5)]
    # streamed: the same text, log-probabilities and usage, in pieces
    body = {"model": "llama", "prompt": LONG, "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": True,
            "ignore_eos": True, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    texts, lps, usage = ["", ""], [[], []], None
    with httpx.stream("POST", served.url + "/v1/completions", timeout=60, json=body) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for ch in chunk["choices"]:
                    texts[ch["index"]] += ch["text"]
                    lps[ch["index"]] += (ch["logprobs"] or {}).get("token_logprobs", [])
    assert texts == [r.choices[0].text] * 2
    # two choices decode as a batch of two, the request above as one: the same within float rounding (a
    # CPU's matrix kernels may differ by batch size), not always to the bit
    for got in lps:
        assert got[0] is None and len(got) == len(lp.token_logprobs)
        torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(lp.token_logprobs[1:]), atol=1e-4, rtol=1e-4)
    assert usage == {"prompt_tokens": P, "completion_tokens": 10, "total_tokens": P + 10}


def test_n_choices_prefill_the_prompt_once(served):
    c, P = served.client, len(served.tok.encode(LONG))
    bt = served.engine.core.scheduler.config.block_tokens
    tail = P - (P - 1) // bt * bt  # what each choice after the first computes itself
    alone = [c.completions.create(model="llama", prompt=LONG, max_tokens=6, seed=11 + i, logprobs=0,
                                  extra_body={"ignore_eos": True}) for i in range(4)]
    before = served.metric("computron_prefill_tokens_total")
    four = c.completions.create(model="llama", prompt=LONG, max_tokens=6, n=4, seed=11, logprobs=0,
                                extra_body={"ignore_eos": True})
    assert served.metric("computron_prefill_tokens_total") - before == P + 3 * tail < 2 * P
    # choice i draws as a request seeded seed + i does
    assert [ch.text for ch in four.choices] == [a.choices[0].text for a in alone]
    for ch, a in zip(four.choices, alone):
        torch.testing.assert_close(ch.logprobs.token_logprobs, a.choices[0].logprobs.token_logprobs,
                                   atol=1e-5, rtol=1e-5)
    assert four.usage.prompt_tokens == P and four.usage.completion_tokens == 24
    greedy = c.completions.create(model="llama", prompt=LONG, max_tokens=6, n=4, temperature=0)
    one = c.completions.create(model="llama", prompt=LONG, max_tokens=6, temperature=0)
    assert [ch.text for ch in greedy.choices] == [one.choices[0].text] * 4
    assert served.idle()["kv"] == 0
