"""The wire format: pydantic models of request bodies, and builders of the OpenAI-shaped replies.

Request bodies follow the OpenAI API (fields this server does not implement are refused with a
400 when set to something other than their neutral value, unknown fields are ignored, as the
official clients send a few). Replies are plain dicts built here: the hot path of a streamed
completion does not pay for pydantic validation of its own output.
"""

from __future__ import annotations

import json
import time
from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

# A seed must fit torch.Generator.manual_seed.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_CHOICES = 16  # n and best_of: each choice is a request of its own in the engine (sharing the prompt's cache)
MAX_STOP = 64  # stop strings per request: each one is searched for after every token


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model: str = Field(description="a registered model (see GET /v1/models)")
    max_tokens: int | None = Field(None, description="tokens to generate at most")
    temperature: float | None = Field(None, description="0 is greedy; default 1")
    top_p: float | None = Field(None, description="nucleus sampling, in (0, 1]; default 1")
    top_k: int | None = Field(None, description="extension: keep the k most likely tokens (0: off)")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = Field(None, description=f"at most {MAX_STOP} strings")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices to generate for the prompt")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="extension: keep generating past the end-of-sequence token")
    min_tokens: int = Field(0, ge=0, description="extension: no end-of-sequence token before this many tokens")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="subtracted from the logit of every "
                                                                        "token generated so far")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="subtracted, times its count, from "
                                                                         "the logit of every token generated")
    repetition_penalty: float | None = Field(None, gt=0, le=10, description="extension: divides positive (multiplies "
                                             "negative) logits of tokens in the prompt or the output; 1 is off")
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100] "
                                                                "added to its logit")
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(v)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is not None:
            if len(v) > 1024:
                raise ValueError(f"at most 1024 logit_bias entries, got {len(v)}")
            bad = [k for k in v if not k.isdigit() or len(k) > 9]
            if bad:
                raise ValueError(f"logit_bias keys must be token ids, got {bad[0]!r}")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field set to something this server cannot do."""
        return None

    def sampling(self, logprobs: int | None = None) -> dict[str, Any]:
        """Keyword arguments for SamplingParams, except max_tokens (its default depends on the prompt)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        stop = self.stop if self.stop is not None else ()
        return dict(temperature=temperature, top_p=1.0 if self.top_p is None else self.top_p,
                    top_k=self.top_k or 0, seed=self.seed, ignore_eos=self.ignore_eos,
                    stop=(stop,) if isinstance(stop, str) else tuple(stop), min_tokens=self.min_tokens,
                    presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                    repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                    logit_bias=tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items()),
                    logprobs=logprobs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]] = Field(
        description="a string or a list of token ids (a list of one of these is accepted too)")
    echo: bool = Field(False, description="the prompt's text before the completion")
    logprobs: int | None = Field(None, ge=0, le=20, description="log-probabilities of each generated token (with "
                                                                "echo, of each prompt token too) and of this many "
                                                                "most likely ones")
    suffix: str | None = Field(None, description="not supported")
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description="generate this many, return the n with "
                                                                        "the highest log-probability")

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of < self.n:
            return "best_of", f"best_of ({self.best_of}) must be at least n ({self.n})"
        if self.stream and self.best_of not in (None, self.n):
            return "best_of", "best_of cannot be streamed unless it equals n"
        return None

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt; a ValueError for a batch of several."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise ValueError(f"prompt holds {len(p)} prompts; send one prompt per request")
            p = p[0]
        return p


class TextPart(_Body):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, description="the newer name of max_tokens")
    logprobs: bool | None = Field(None, description="log-probabilities of each generated token")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="and of this many most likely ones")
    tools: list[dict] | None = Field(None, description="not supported")
    response_format: dict | None = Field(None, description="only {'type': 'text'}")

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.tools:
            return "tools", "tools are not supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "only the 'text' response format is supported"
        return None

    best_of: ClassVar[None] = None  # completions only
    echo: ClassVar[bool] = False

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class RegisterModelRequest(_Body):
    source: str = Field(description="a preset name, or a checkpoint directory inside the server's model directories")
    alias: str | None = Field(None, min_length=1, description="the name to serve it under (default: the preset "
                                                              "name or the directory's name)")
    pinned: bool = False
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of a preset's random weights")
    load: bool = Field(False, description="swap it in right after registering")


# ---- replies --------------------------------------------------------------------------------

FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def reply(rid: str, model: str, created: int, choices: list[dict], chat: bool, chunk: bool = False) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}


def choice(index: int, text: str | None, finish: str | None, chat: bool, chunk: bool = False,
           logprobs: dict | None = None, delta: dict | None = None) -> dict:
    """One choice: completions carry ``text``; chat a ``message``, or in a stream a ``delta``."""
    if not chat:
        return {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
    if chunk:
        body = delta if delta is not None else ({} if text is None else {"content": text})
        return {"index": index, "delta": body, "finish_reason": finish, "logprobs": logprobs}
    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
            "logprobs": logprobs}


def token_logprobs(tok, entries: list, chat: bool, offset: int = 0) -> dict:
    """The ``logprobs`` of a choice from the engine's (logprob, [(id, logprob)]) per token (None for a
    prompt's first token, which has none): the completions shape (tokens, token_logprobs,
    top_logprobs, text_offset from ``offset``) or the chat shape (content: token, logprob, bytes,
    top_logprobs)."""
    def text(i: int) -> str:
        return tok.decode([i])

    def raw(i: int) -> list[int]:
        b = tok.token_bytes([i])
        return list(b if b is not None else text(i).encode())

    if chat:
        return {"content": [{"token": text(t), "logprob": lp, "bytes": raw(t),
                             "top_logprobs": [{"token": text(i), "logprob": v, "bytes": raw(i)} for i, v in top]}
                            for t, (lp, top) in entries]}
    tokens, offsets = [], []
    for t, _ in entries:
        offsets.append(offset)
        tokens.append(text(t))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e[0] if e else None for _, e in entries],
            "top_logprobs": [_by_text(e[1], text) if e else None for _, e in entries], "text_offset": offsets}


def _by_text(top: list, text) -> dict:
    """Completions' top_logprobs are keyed by text: of ids with the same text, the likeliest one."""
    out: dict[str, float] = {}
    for i, v in top:
        out.setdefault(text(i), v)
    return out


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse(data: dict | str) -> bytes:
    """One server-sent event carrying ``data`` (a dict as compact JSON, or a literal such as [DONE])."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
