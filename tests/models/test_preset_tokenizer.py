"""Preset tokenizers: a byte-level BPE directory that outside libraries load, ids inside the model's
vocabulary, specials at the config's ids, deterministic, cached, written by ``computron tokenizer``."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from transformers import AutoTokenizer

from computron.cli import main as cli_main
from computron.models import PRESETS, decode_stream, get_preset, load_tokenizer
from computron.models.preset_tokenizer import _trained, preset_tokenizer_dir, write_tokenizer

TEXTS = ["Hello world, the model answers quickly.", "héllo 🦊 日本語 Модель", "", "  spaces\tand\nnewlines ",
         "def f(x): return x + 1  # 2024-05-17"]


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("COMPUTRON_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama", "tiny-gpt2", "opt-125m", "gpt2", "llama-2-7b", "llama-3-8b"])
def test_outside_libraries_load_it_and_count_as_the_server(name):
    cfg = get_preset(name)
    path = preset_tokenizer_dir(cfg)
    ours, rust = load_tokenizer(None, cfg), RustTokenizer.from_file(str(path / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(path))
    ids = rust.get_vocab(with_added_tokens=True).values()
    assert max(ids) < cfg.vocab_size and len(set(ids)) == len(ids)
    assert (ours.bos_token_id, ours.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id)
    assert (hf.bos_token_id, hf.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id)
    assert ours.add_bos == (cfg.family != "gpt2")
    for text in TEXTS:
        mine = ours.encode(text)
        assert hf(text).input_ids == rust.encode(text).ids == mine  # prompt_tokens as a client counts them
        assert hf.decode(mine, skip_special_tokens=True) == ours.decode(mine) == text
    assert len(ours.encode(TEXTS[0])) < len(TEXTS[0]) // 2  # merges were learnt and are used


def test_tiny_presets_fill_their_vocabulary_and_keep_bytes_in_place():
    tok = load_tokenizer(None, get_preset("tiny-opt"))
    assert tok.vocab_size == 512 and len(tok.tok.get_vocab()) == 512
    assert [tok.decode([i]) for i in range(ord("a"), ord("e"))] == list("abcd")  # ids 0-255 are the bytes
    assert len(_trained()[1]) > 1000  # the large presets get every merge the corpus gives


@settings(max_examples=80, deadline=None)
@given(st.text())
def test_any_text_round_trips(text):
    """Any text but one holding a special token's text (``<s>``), which encodes as that token and
    decodes to nothing (tests/models/test_tokenizers.py)."""
    tok = load_tokenizer(None, get_preset("tiny-llama"))
    assume(not any(s.content in text for s in tok.tok.get_added_tokens_decoder().values()))
    ids = tok.encode(text)
    assert tok.decode(ids) == text and "".join(decode_stream(tok, ids)) == text


def test_retokenizing_differs_only_for_ids_that_are_not_the_tokenizers_own_encoding():
    """What a client that re-tokenizes streamed text can and cannot count: a sampled sequence that
    spells a merged token in pieces ("t", "he" for " the") decodes to the same text as the merged
    token, so re-tokenizing it gives the canonical, shorter count."""
    tok = load_tokenizer(None, get_preset("opt-125m"))
    (the,) = tok.encode(" the")[1:]
    pieces = [i for i in (tok.tok.token_to_id("Ġ"), tok.tok.token_to_id("the")) if i is not None]
    assert len(pieces) == 2 and tok.decode(pieces) == tok.decode([the]) == " the"
    assert tok.encode(tok.decode(pieces))[1:] == [the]


def test_build_is_deterministic_and_cached(tmp_path):
    cfg = get_preset("tiny-gpt2")
    first = preset_tokenizer_dir(cfg)
    assert preset_tokenizer_dir(cfg) == first
    code = ("import sys; from computron.models import get_preset; from computron.models.preset_tokenizer import "
            "write_tokenizer; write_tokenizer(get_preset('tiny-gpt2'), sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "fresh")], check=True)  # trained anew there
    assert (tmp_path / "fresh" / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()


def test_cli_help_trains_nothing(tmp_path):
    env_code = "import sys; sys.argv = ['computron', '--help']; from computron.cli import main; main()"
    out = subprocess.run([sys.executable, "-c", env_code], capture_output=True, text=True,
                         env={"COMPUTRON_CACHE": str(tmp_path / "c"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and "tokenizer" in out.stdout
    assert not (tmp_path / "c").exists()


def test_cli_writes_the_directory_under_any_name_of_the_preset(tmp_path, capsys):
    assert cli_main(["tokenizer", "GPT2-1.5B", "--out", str(tmp_path / "t")]) == 0
    assert "gpt2-xl" in capsys.readouterr().out
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "t"))
    assert hf("the model").input_ids == load_tokenizer(None, PRESETS["gpt2-xl"]).encode("the model")
    assert hf.model_max_length == 1024
    assert cli_main(["tokenizer", "gpt-9", "--out", str(tmp_path / "u")]) == 2
    assert "unknown model 'gpt-9'" in capsys.readouterr().err


def test_a_vocabulary_too_small_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot hold the 256 byte tokens"):
        write_tokenizer(get_preset("tiny-opt").with_(vocab_size=200), tmp_path)


def test_a_preset_wider_than_its_tokenizer_samples_only_ids_with_text(monkeypatch):
    """A preset whose vocabulary outgrows its BPE (opt-125m: 50,272 ids, ~1,300 with text) has random
    weights that would mostly sample ids without text: the engine masks them, so sampled output
    is all tokenizer ids and the text is not empty."""
    from computron.config import EngineConfig
    from computron.engine import Engine, SamplingParams
    from computron.models.preset_tokenizer import token_ids

    wide = get_preset("tiny-opt").with_(name="tiny-wide", vocab_size=4096)
    monkeypatch.setitem(PRESETS, "tiny-wide", wide)
    allowed = set(token_ids(wide))
    assert len(allowed) < 4096 // 2  # without the mask, most draws would fall outside
    eng = Engine(EngineConfig(device="cpu", gpu_memory_budget=64 * 2**20, workspace_bytes=200_000))
    eng.register_model("tiny-wide")
    out = eng.generate("tiny-wide", "hello", SamplingParams(max_tokens=48, temperature=1.0, seed=3, ignore_eos=True))
    assert out.error is None and len(out.output_ids) == 48
    assert set(out.output_ids) <= allowed
    assert len(out.text) >= 48  # every token has text (bytes or merges)
