"""Tokenizers: byte-level fallback, tokenizer.json via ``tokenizers``, chat templates, streaming decode."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from computron.models import IncrementalDecoder, decode_stream, get_preset, load_tokenizer
from computron.models.tokenizer import ByteTokenizer, HFTokenizer

CORPUS = ["hello world, héllo wörld", "the quick brown fox 🦊 jumps", "日本語のテキスト", "emoji 😀👍🏽 ok"] * 20
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
SAMPLES = ["hello world", "héllo 🦊 日本語", "", "  spaces  and\nnewlines\t", "👍🏽👨‍👩‍👧"]


def _bpe() -> RustTokenizer:
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe")
    _bpe().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True, "chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def bpe(bpe_dir):
    return load_tokenizer(bpe_dir, get_preset("tiny-llama"))


def test_tokenizer_json_loads_and_round_trips(bpe):
    assert isinstance(bpe, HFTokenizer)
    assert (bpe.bos_token_id, bpe.eos_token_id, bpe.vocab_size) == (0, 1, bpe.tok.get_vocab_size())
    for text in SAMPLES:
        ids = bpe.encode(text)
        assert ids[0] == bpe.bos_token_id  # add_bos_token: true
        assert bpe.decode(ids) == text
    assert len(bpe.encode("hello world")) < len("hello world")  # merges were learnt and used


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_tokenizer_json_round_trips_any_text(bpe, text):
    assume(not any(s.content in text for s in bpe.tok.get_added_tokens_decoder().values()))  # that is a token (below)
    assert bpe.decode(bpe.encode(text)) == text
    assert "".join(decode_stream(bpe, bpe.encode(text))) == text


def test_a_special_tokens_text_encodes_as_that_token_and_decodes_to_nothing(bpe):
    """As a chat template needs (its ``<s>`` is the BOS token, not three characters); decoding drops
    special tokens, so such a text does not come back whole."""
    ids = bpe.encode("a<s>b</s>c")
    assert ids[0] == bpe.bos_token_id and ids.count(bpe.bos_token_id) == 2 and bpe.eos_token_id in ids
    assert bpe.decode(ids) == "abc" == "".join(decode_stream(bpe, ids))


def test_decode_never_raises_on_bad_ids(bpe):
    assert bpe.decode([-5, 10**9, 2**40]) == ""
    assert ByteTokenizer(get_preset("tiny-opt")).decode([-1, 256, 257, 511, 10**9, 104, 105]) == "hi"


def test_chat_template_from_tokenizer_config(bpe):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = bpe.apply_chat_template(messages)
    assert prompt == "<s><|system|>be brief</s><|user|>hi</s><|assistant|>"
    ids = bpe.encode(prompt)
    assert ids[0] == bpe.bos_token_id and ids[1] != bpe.bos_token_id  # no doubled BOS


def test_chat_template_file_and_sandbox(tmp_path):
    _bpe().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    tok = load_tokenizer(tmp_path, get_preset("tiny-llama"))
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        load_tokenizer(tmp_path, get_preset("tiny-llama")).apply_chat_template([{"role": "user", "content": "x"}])


def test_default_chat_format():
    tok = load_tokenizer(None, get_preset("tiny-gpt2"))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]
    assert tok.apply_chat_template(messages) == "user: hi\nassistant: yo\nassistant:"
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])


def test_post_processor_bos_is_detected(tmp_path):
    tok = _bpe()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))  # no tokenizer_config.json: BOS comes from the post-processor
    ours = load_tokenizer(tmp_path, get_preset("tiny-gpt2").with_(bos_token_id=0))
    assert ours.add_bos and ours.encode("hello")[0] == 0 and ours.encode("hello").count(0) == 1


def test_vocab_and_merges_files(tmp_path):
    tok = _bpe()
    tok.model.save(str(tmp_path))  # vocab.json + merges.txt, GPT-2 style
    ours = load_tokenizer(tmp_path, get_preset("tiny-gpt2"))
    assert ours.encode("héllo 🦊") == tok.encode("héllo 🦊").ids
    assert ours.decode(ours.encode("héllo 🦊")) == "héllo 🦊"


def test_directory_without_tokenizer_falls_back_to_bytes(tmp_path):
    assert isinstance(load_tokenizer(tmp_path, get_preset("tiny-opt")), ByteTokenizer)


def test_byte_tokenizer_specials():
    llama, gpt2 = ByteTokenizer(get_preset("tiny-llama")), ByteTokenizer(get_preset("tiny-gpt2"))
    assert (llama.bos_token_id, llama.eos_token_id, llama.vocab_size) == (256, 257, 258)
    assert llama.encode("hi") == [256, 104, 105]  # Llama and OPT prepend BOS
    assert gpt2.encode("hi") == [104, 105]  # GPT-2 does not
    bare = ByteTokenizer(get_preset("tiny-opt").with_(bos_token_id=None, eos_token_id=None))
    assert (bare.vocab_size, bare.encode("hi")) == (256, [104, 105])
    assert llama.encode("\ud800x") == [256, 0xEF, 0xBF, 0xBD, ord("x")]  # a lone surrogate becomes U+FFFD


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text):
    tok = ByteTokenizer(get_preset("tiny-llama"))
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", SAMPLES + ["😀€\u00e9\U0010FFFF"])
def test_incremental_decode_byte_by_byte(text):
    tok = ByteTokenizer(get_preset("tiny-gpt2"))
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(b) for b in text.encode("utf-8")]
    assert all("\ufffd" not in p for p in pieces)  # never half a character
    assert "".join(pieces) + dec.flush() == text
    assert sum(1 for p in pieces if p) == len(text)  # each character appears as soon as it is complete


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-2, max_value=300), max_size=40))
def test_stream_equals_full_decode_for_any_ids(ids):
    tok = ByteTokenizer(get_preset("tiny-opt"))
    assert "".join(decode_stream(tok, ids)) == tok.decode(ids)
