"""Streamed text: bytes that can never become a character come out as U+FFFD at once, instead of
being held until the end of the stream; bytes that may still complete a character are held."""

from __future__ import annotations

import json

import httpx
from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, trainers

from computron.models import IncrementalDecoder, get_preset
from computron.models.tokenizer import _UNICODE_TO_BYTE, ByteTokenizer, HFTokenizer


def pushes(tok, ids) -> list[str]:
    d = IncrementalDecoder(tok)
    return [d.push(i) for i in ids] + [d.flush()]


def test_byte_tokenizer_releases_what_cannot_complete():
    tok = ByteTokenizer(get_preset("tiny-opt"))
    # stray continuation bytes: out at once; a euro sign: held for 2 bytes, then whole;
    # a lead byte followed by 'A': both out at once; an unfinished character at the end: on flush
    ids = [0x80, 0x80, 0xE2, 0x82, 0xAC, 0xE2, 0x41, 0xF0, 0x9F, 0x98, 0x80, 0xE2, 0x82]
    assert pushes(tok, ids) == ["\ufffd", "\ufffd", "", "", "€", "", "\ufffdA", "", "", "", "😀", "", "", "\ufffd"]
    assert "".join(pushes(tok, ids)) == tok.decode(ids)


def test_byte_level_bpe_releases_what_cannot_complete():
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = HFTokenizer(rust, {}, get_preset("tiny-gpt2"))
    for text in ("hello €uro 😀", "naïve world"):
        ids = tok.encode(text)
        assert tok.token_bytes(ids) == text.encode()
        assert "".join(pushes(tok, ids)) == text
    stray = rust.token_to_id(next(c for c, b in _UNICODE_TO_BYTE.items() if b == 0x80))  # a continuation byte
    lead = rust.token_to_id(next(c for c, b in _UNICODE_TO_BYTE.items() if b == 0xE2))
    assert pushes(tok, [stray, stray, lead]) == ["\ufffd", "\ufffd", "", "\ufffd"]


def test_stream_of_invalid_utf8_is_not_held_to_the_end(live, reference):
    """tiny-llama's greedy output holds stray continuation bytes: the stream must not hold its text
    back until the last token (time to first token = the whole latency), and still equal it."""
    ref = reference("tiny-llama", "hello", 32)
    assert "\ufffd" in ref.text
    chunks = []
    with httpx.stream("POST", live.url + "/v1/completions", json={
            "model": "tiny-llama", "prompt": "hello", "max_tokens": 32, "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
    texts = [c for c in chunks if c]
    assert "".join(texts) == ref.text
    assert len(texts) >= 6, texts
