"""The tokenizer of a preset: a small byte-level BPE, trained once from a built-in corpus and cached.

What flows through: a preset's :class:`ModelConfig` (vocabulary size, BOS/EOS ids, family) becomes
a Hugging Face style tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``) that ``tokenizers.Tokenizer.from_file`` and
``transformers.AutoTokenizer.from_pretrained`` load, so outside clients count tokens as the server
does. The BPE is trained by the ``tokenizers`` library (deterministic for a fixed corpus) from
:data:`CORPUS` below; ids are laid out as the preset's model expects: the 256 byte tokens first in
byte order, then merges by rank, skipping the ids of the BOS/EOS specials, which sit at the config's
ids. Merges stop where the vocabulary would not fit the model (254 of them for the tiny presets);
model ids past the tokenizer's are unused (as in OPT's real 50265-token tokenizer under a 50272-row
embedding), and a preset's random weights never sample them (the executor masks their logits,
``token_ids``): a 50k-row preset would otherwise answer mostly ids with no text. Built on first use into ``$COMPUTRON_CACHE/tokenizers/`` (default
``~/.cache/computron``), keyed by what shapes it; CPU only, no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from .config import ModelConfig

VERSION = 1
MAX_MERGES = 4000

# Written for this purpose: varied English prose, some accented and non-Latin text, digits and code.
CORPUS = """\
Computron serves many language models on a small set of shared GPUs. The weights of every model wait
in pinned host memory, and a model is copied onto the GPUs only when a request for it arrives. While
the first layers are still being copied, the earliest ones are already computing, so the first token
of a cold request comes sooner than a full copy would allow. When memory runs short, the scheduler
evicts the model that was used least recently and has no request waiting for it.
A request is a prompt and a few sampling parameters: the temperature, the nucleus mass, the number of
tokens to generate, and the strings at which to stop. The server answers with the generated text and
the number of tokens in the prompt and in the completion. Streaming clients receive the text piece by
piece, as soon as each character is complete.
The planner looks for the best way to train a large model on a cluster of machines with different
accelerators. It weighs data parallelism, tensor parallelism and pipeline parallelism against each
other, counts the bytes each device must hold, and estimates the time of every step from the speed of
its links and the throughput of its arithmetic units. The cheapest plan is not always the fastest one.
On a quiet morning the river was smooth and grey, and the boats moved slowly past the old stone bridge.
A child counted them aloud: one, two, three, four, five, six, seven, eight, nine, ten. Her brother said
that counting boats was a strange hobby, but he counted with her anyway, and they reached forty-two
before the bell of the church rang noon. They walked home through the market, where the sellers were
packing away apples, pears, cheese, bread, fish and flowers. Their grandmother had made soup with
carrots, onions, potatoes and beans, and everybody agreed it was the best soup of the whole winter.
What should a good tokenizer do? It should split common words into few pieces and rare words into
more, it should never lose a byte, and it should turn any string back into exactly the same string.
Questions, answers, lists and tables: all of them are text, and all of them must survive the trip.
Numbers appear everywhere: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 100 128 256 512 1000 1024 2048 4096 8192,
prices like 3.50 and 12.99, dates like 2024-05-17, times like 09:30, and versions like 1.2.3.
def forward(self, hidden_states, positions):
    query, key, value = self.qkv(hidden_states).split(self.sizes, dim=-1)
    return self.out(attention(query, key, value, positions))
for i in range(len(items)): total += items[i] * weights[i]
if (x > 0 && y < 10) { return x + y; } else { return -1; }
{"model": "opt-125m", "prompt": "Hello", "max_tokens": 16, "temperature": 0.7, "stream": true}
Le modèle répond vite, même quand la mémoire est pleine; les requêtes attendent leur tour.
Das Modell antwortet schnell, auch wenn der Speicher voll ist; größere Modelle brauchen länger.
El modelo responde rápido, incluso cuando la memoria está llena; la señal llega pronto.
Модель отвечает быстро, даже когда память заполнена.
模型在内存满的时候也能很快地回答。
モデルはメモリがいっぱいでもすぐに答えます。
모델은 메모리가 가득 차도 빠르게 대답합니다.
Emoji and symbols also pass through: 😀 👍 🚀 ✓ → € £ ¥ ° ± × ÷ …
"""


def _special_names(cfg: ModelConfig) -> dict[int, str]:
    """The specials' ids and texts: one ``<|endoftext|>`` when BOS and EOS share an id."""
    bos, eos = cfg.bos_token_id, cfg.eos_token_id
    if bos is not None and bos == eos:
        return {bos: "<|endoftext|>"}
    return {i: t for i, t in ((bos, "<s>"), (eos, "</s>")) if i is not None}


@lru_cache(maxsize=1)
def _trained() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(the 256 byte tokens in byte order, the merges by rank) learnt from :data:`CORPUS`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from .tokenizer import _UNICODE_TO_BYTE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=256 + MAX_MERGES, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = tuple(tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges)
    byte_tokens = tuple(sorted(_UNICODE_TO_BYTE, key=_UNICODE_TO_BYTE.__getitem__))
    return byte_tokens, merges


def _build(cfg: ModelConfig):
    """A ``tokenizers.Tokenizer`` for ``cfg`` (see the module docstring for the id layout)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    specials = _special_names(cfg)
    byte_tokens, merges = _trained()
    room = cfg.vocab_size - len(byte_tokens) - sum(1 for i in specials if i < cfg.vocab_size)
    if room < 0 or any(i >= cfg.vocab_size or i < 0 for i in specials):
        raise ValueError(f"model {cfg.name}: a vocabulary of {cfg.vocab_size} ids cannot hold the 256 byte "
                         f"tokens and the specials {specials}")
    merges = merges[:room]
    vocab, next_id = dict(zip(specials.values(), specials)), 0
    for token in byte_tokens + tuple(a + b for a, b in merges):
        while next_id in specials:
            next_id += 1
        vocab[token], next_id = next_id, next_id + 1
    tok = Tokenizer(models.BPE(vocab, list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials.values()))
    if cfg.family in ("opt", "llama") and cfg.bos_token_id is not None:  # those families prepend BOS
        bos = specials[cfg.bos_token_id]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, cfg.bos_token_id)])
    return tok


def _key(cfg: ModelConfig) -> str:
    shape = [VERSION, MAX_MERGES, CORPUS, cfg.family, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id]
    return hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16]


def cache_root() -> Path:
    root = os.environ.get("COMPUTRON_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "computron")
    return Path(root) / "tokenizers"


def write_tokenizer(cfg: ModelConfig, out: str | Path) -> Path:
    """Write ``cfg``'s tokenizer directory to ``out`` (created if needed); returns ``out``."""
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    specials = _special_names(cfg)
    name = lambda i: specials.get(i) if i is not None else None  # noqa: E731
    _build(cfg).save(str(out / "tokenizer.json"))
    special_map = {k: v for k, v in (("bos_token", name(cfg.bos_token_id)), ("eos_token", name(cfg.eos_token_id)))
                   if v is not None}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_position,
              "clean_up_tokenization_spaces": False, **special_map}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def preset_tokenizer_dir(cfg: ModelConfig) -> Path:
    """The cached tokenizer directory of preset ``cfg``, built on first use (atomically)."""
    path = cache_root() / f"{cfg.name}-{_key(cfg)}"
    if (path / "tokenizer.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cfg.name}-", dir=path.parent))
    try:
        write_tokenizer(cfg, tmp)
        try:
            tmp.rename(path)
        except OSError:  # another process built it first
            if not (path / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def token_ids(cfg: ModelConfig) -> list[int]:
    """The ids a preset's tokenizer has text for (its bytes, merges and specials), ascending; a
    preset model's other ids are unused."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(preset_tokenizer_dir(cfg) / "tokenizer.json"))
    return sorted(set(tok.get_vocab(with_added_tokens=True).values()))
