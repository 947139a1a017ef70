"""Tokenizers: text ↔ token ids for the server, and chat messages → one prompt string.

What flows through: request text (or OpenAI-style chat messages, rendered by the checkpoint's
Jinja2 ``chat_template`` in a sandbox) becomes a list of ids; generated ids come back as text,
token by token through :class:`IncrementalDecoder` so a streamed multi-byte character is never
split. A checkpoint with ``tokenizer.json`` (or GPT-2-style ``vocab.json`` + ``merges.txt``) uses
the ``tokenizers`` library, and so does a preset (a small byte-level BPE built by
``preset_tokenizer``); a checkpoint without tokenizer files gets :class:`ByteTokenizer` (ids 0-255
are UTF-8 bytes, the config's BOS/EOS ids are specials). Pure CPU, no torch.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from functools import lru_cache
from pathlib import Path

from .config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_CHAT_FORMAT = "'role: content' lines, one per message, then 'assistant:'"


def _clean(text: str) -> str:
    """``text`` with lone surrogates (not encodable as UTF-8) replaced by U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)


def _content(message: dict) -> str:
    """A message's text; OpenAI content-part lists are joined by their text parts."""
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


class Tokenizer:
    """What every tokenizer offers: encode, decode, specials and chat rendering.

    ``encode`` prepends BOS when ``add_bos`` is set and the text does not already start with it
    (a chat template usually writes ``{{ bos_token }}`` itself). ``decode`` accepts any ids: ids
    it does not know and special tokens are skipped, so it never raises.
    """

    bos_token_id: int | None
    eos_token_id: int | None
    vocab_size: int  # ids this tokenizer can name; the model's vocabulary may be larger
    add_bos: bool
    chat_template: str | None = None

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def _token(self, token_id: int | None) -> str:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def token_bytes(self, ids) -> bytes | None:
        """The raw bytes ``ids`` stand for, where this tokenizer knows them (None otherwise)."""
        return None

    def encode(self, text: str) -> list[int]:
        ids = self._encode(_clean(text))
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt for ``messages`` (dicts with ``role`` and ``content``), ready for :meth:`encode`.

        With a checkpoint ``chat_template`` it is rendered in Jinja2's sandbox with ``messages``,
        ``add_generation_prompt``, ``bos_token`` and ``eos_token``; without one the default is
        ``"role: content\\n"`` per message followed by ``"assistant:"``.
        """
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"a chat message must be a dict with a string 'role', got {m!r}")
        if self.chat_template is None:
            lines = [f"{m['role']}: {_content(m)}\n" for m in messages]
            return "".join(lines) + ("assistant:" if add_generation_prompt else "")
        return _render(self.chat_template, messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self._token(self.bos_token_id), eos_token=self._token(self.eos_token_id))


@lru_cache(maxsize=16)
def _compile(template: str):
    """A chat template compiled in Jinja2's immutable sandbox, with the helpers HF templates call."""
    from datetime import datetime

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def _render(template: str, **variables) -> str:
    try:
        return _compile(template).render(**variables)
    except ValueError:  # raise_exception() in the template: its message is the error
        raise
    except Exception as e:  # syntax errors, sandbox refusals, type errors on odd message content
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0-255, plus the config's BOS/EOS ids; every text round-trips exactly."""

    def __init__(self, cfg: ModelConfig, add_bos: bool | None = None, chat_template: str | None = None):
        if cfg.vocab_size < 256:
            raise ValueError(f"model {cfg.name} has {cfg.vocab_size} ids, fewer than the 256 byte tokens")
        self.bos_token_id, self.eos_token_id = cfg.bos_token_id, cfg.eos_token_id
        self.vocab_size = max([256] + [i + 1 for i in (cfg.bos_token_id, cfg.eos_token_id) if i is not None])
        self.add_bos = cfg.family in ("opt", "llama") if add_bos is None else add_bos
        self.chat_template = chat_template

    def _encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def _token(self, token_id: int | None) -> str:
        return ""  # specials have no text form here

    def decode(self, ids) -> str:
        return self.token_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, ids) -> bytes:
        return bytes(int(i) for i in ids if 0 <= i < 256)


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` with the specials and chat template of ``tokenizer_config.json``."""

    def __init__(self, tok, tok_config: dict, cfg: ModelConfig, chat_template: str | None = None):
        self.tok = tok
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1  # ids may have gaps

        def special(key: str, fallback: int | None) -> int | None:
            value = tok_config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            found = tok.token_to_id(value) if isinstance(value, str) else None
            return found if found is not None else fallback

        self.bos_token_id = special("bos_token", cfg.bos_token_id)
        self.eos_token_id = special("eos_token", cfg.eos_token_id)
        add_bos = tok_config.get("add_bos_token")
        if add_bos is None:  # does tokenizer.json's post-processor add BOS itself?
            with_specials = tok.encode("a", add_special_tokens=True).ids
            add_bos = self.bos_token_id is not None and with_specials[:1] == [self.bos_token_id]
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def _token(self, token_id: int | None) -> str:
        return (self.tok.id_to_token(token_id) or "") if token_id is not None else ""

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=True)

    def token_bytes(self, ids) -> bytes:
        """Byte-level BPE (GPT-2, OPT, Llama 3): each character of a token names one byte;
        SentencePiece (Llama 2): ``<0xNN>`` byte-fallback tokens are bytes, others UTF-8 text."""
        from tokenizers import decoders

        byte_level = isinstance(self.tok.decoder, decoders.ByteLevel)
        out = bytearray()
        for i in ids:
            piece = self.tok.id_to_token(int(i)) if 0 <= i < self.vocab_size else None
            if piece is None:
                continue
            if byte_level:
                out.extend(_UNICODE_TO_BYTE.get(c, 0x3F) for c in piece)
            elif _BYTE_TOKEN.fullmatch(piece):
                out.append(int(piece[3:5], 16))
            else:
                out.extend(piece.replace("\u2581", " ").encode())
        return bytes(out)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes stand for
    themselves, the others are mapped in order onto code points from 256 up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return {chr(b if b in keep else next(extra)): b for b in range(256)}


_UNICODE_TO_BYTE = _byte_level_alphabet()
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class IncrementalDecoder:
    """Streams text for ids arriving one at a time, never emitting half a character.

    Text is re-decoded over a short window (the previous chunk's ids plus the new ones), so
    tokenizers whose decoding depends on the preceding token (leading spaces) stream correctly.
    While the window ends in U+FFFD the text is held back, but only as long as its last bytes
    can still grow into a character: bytes that never can (a stray continuation byte, a lead
    byte followed by a non-continuation) come out as U+FFFD at once. Where the tokenizer cannot
    name its tokens' bytes, text is held for at most 3 tokens (a character has at most 4 bytes).
    ``"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids)``.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids = tokenizer, []
        self.prefix, self.read = 0, 0  # ids[prefix:read]: already emitted context; ids[read:]: pending

    def _pending(self) -> str:
        done = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        return text[len(done) :]

    def push(self, token_id: int) -> str:
        """The new text that ``token_id`` completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        new = self._pending()
        if not new or (new.endswith("\ufffd") and self._may_complete()):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return new

    def _may_complete(self) -> bool:
        """Could the held bytes still become a character with more tokens?"""
        raw = self.tokenizer.token_bytes(self.ids[self.read:])
        if raw is None:
            return len(self.ids) - self.read < 4
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        dec.decode(raw[-4:], final=False)
        return bool(dec.getstate()[0])  # the bytes it keeps waiting for their continuation

    def flush(self) -> str:
        """Whatever is still held back (incomplete bytes become U+FFFD); call once at the end."""
        new = self._pending()
        self.prefix = self.read = len(self.ids)
        return new


def decode_stream(tokenizer: Tokenizer, ids):
    """Yield text pieces for an iterable of ids, as a server streams them (see IncrementalDecoder)."""
    dec = IncrementalDecoder(tokenizer)
    for i in ids:
        piece = dec.push(i)
        if piece:
            yield piece
    tail = dec.flush()
    if tail:
        yield tail


def _chat_template(path: Path, tok_config: dict) -> str | None:
    """The template from tokenizer_config.json, or chat_template.jinja / .json (transformers 5 layout)."""
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if template is None and (path / "chat_template.json").is_file():
        template = json.loads((path / "chat_template.json").read_text()).get("chat_template")
    return template if isinstance(template, str) else None


def load_tokenizer(path: str | Path | None, cfg: ModelConfig) -> Tokenizer:
    """The tokenizer of checkpoint directory ``path``, or of preset ``cfg`` for ``None``."""
    if path is None:
        from .preset_tokenizer import preset_tokenizer_dir

        path = preset_tokenizer_dir(cfg)
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ValueError(f"tokenizer directory {path} does not exist")
    config_file = path / "tokenizer_config.json"
    try:
        tok_config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template = _chat_template(path, tok_config)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read tokenizer files in {path}: {e}") from e
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers

    try:
        if (path / "tokenizer.json").is_file():
            tok = RustTokenizer.from_file(str(path / "tokenizer.json"))
        elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():  # GPT-2 / OPT style BPE
            tok = RustTokenizer(models.BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt")))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
        else:
            log.warning("no tokenizer.json in %s: using the byte tokenizer", path)
            return ByteTokenizer(cfg, chat_template=template)
    except Exception as e:  # the Rust library raises a bare Exception for malformed files
        raise ValueError(f"cannot load the tokenizer in {path}: {e}") from e
    return HFTokenizer(tok, tok_config, cfg, template)
