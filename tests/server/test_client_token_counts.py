"""A benchmark client's token counts against the server's usage, for presets.

The client does what vLLM's ``benchmark_serving.py`` does: it gets the served model's tokenizer
(here ``computron tokenizer PRESET --out DIR``), loads it with ``transformers``, streams a
completion and re-tokenizes the streamed text (``add_special_tokens=False``) to count output tokens,
and counts the prompt with the tokenizer's specials. Re-tokenizing gives the server's count exactly
when the generated ids are the tokenizer's own encoding of their text; a model with random weights
emits arbitrary ids (" the" as " t" + "he", a multi-byte character split), whose text the tokenizer
encodes into fewer tokens. So the completion is restricted by ``logit_bias`` to whole-word tokens
(" " + letters), any sequence of which is its text's own encoding; the sampling stays random.
"""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from computron.cli import main as cli_main

PROMPT = "Numbers appear everywhere: héllo 🦊 the model"


@pytest.fixture(scope="module", params=["tiny-opt", "tiny-gpt2"])
def served_tokenizer(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    assert cli_main(["tokenizer", request.param, "--out", str(out)]) == 0
    return request.param, AutoTokenizer.from_pretrained(str(out))


def _word_tokens(tok) -> list[int]:
    words = [i for t, i in tok.get_vocab().items() if t[:1] == "Ġ" and t[1:].isascii() and t[1:].isalpha()]
    assert len(words) >= 20
    return sorted(i for i in words if tok(tok.decode([i]), add_special_tokens=False).input_ids == [i])


def test_streamed_text_retokenized_counts_as_the_server(live, served_tokenizer):
    model, tok = served_tokenizer
    words = _word_tokens(tok)
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    for seed in range(3):
        stream = c.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=seed,
                                      logit_bias={str(i): 100 for i in words}, stream=True,
                                      stream_options={"include_usage": True})
        text, usage = "", None
        for chunk in stream:
            text += "".join(ch.text for ch in chunk.choices)
            usage = chunk.usage or usage
        assert usage.completion_tokens == 20 and text
        assert len(tok(text, add_special_tokens=False).input_ids) == usage.completion_tokens
        assert len(tok(PROMPT).input_ids) == usage.prompt_tokens  # BOS counted for OPT, not for GPT-2
