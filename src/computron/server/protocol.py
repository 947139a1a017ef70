"""The wire format: pydantic models of request bodies, and builders of the OpenAI-shaped replies.

Request bodies follow the OpenAI API (fields this server does not implement are refused with a
400 when set to something other than their neutral value, unknown fields are ignored, as the
official clients send a few). Replies are plain dicts built here: the hot path of a streamed
completion does not pay for pydantic validation of its own output.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

# A seed must fit torch.Generator.manual_seed.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
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
    n: int = Field(1, description="only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="extension: keep generating past the end-of-sequence token")
    presence_penalty: float | None = Field(None, description="not supported: only 0")
    frequency_penalty: float | None = Field(None, description="not supported: only 0")
    logit_bias: dict[str, float] | None = Field(None, description="not supported")
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(v)}")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field set to something this server cannot do."""
        if self.n != 1:
            return "n", f"n must be 1 (several choices per request are not supported), got {self.n}"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return name, f"{name} is not supported (only 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments for SamplingParams, except max_tokens (its default depends on the prompt)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        stop = self.stop if self.stop is not None else ()
        return dict(temperature=temperature, top_p=1.0 if self.top_p is None else self.top_p,
                    top_k=self.top_k or 0, seed=self.seed, ignore_eos=self.ignore_eos,
                    stop=(stop,) if isinstance(stop, str) else tuple(stop))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]] = Field(
        description="a string or a list of token ids (a list of one of these is accepted too)")
    echo: bool = Field(False, description="not supported")
    logprobs: int | None = Field(None, description="not supported")
    suffix: str | None = Field(None, description="not supported")
    best_of: int | None = Field(None, description="only 1")

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of must be 1"
        return super().unsupported()

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
    logprobs: bool | None = Field(None, description="not supported")
    top_logprobs: int | None = Field(None, description="not supported")
    tools: list[dict] | None = Field(None, description="not supported")
    response_format: dict | None = Field(None, description="only {'type': 'text'}")

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs", "logprobs are not supported"
        if self.tools:
            return "tools", "tools are not supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "only the 'text' response format is supported"
        return super().unsupported()

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


def completion(rid: str, model: str, created: int, text: str, finish: str | None, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}], "usage": use}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}


def chat_completion(rid: str, model: str, created: int, text: str, finish: str | None, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish, "logprobs": None}], "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse(data: dict | str) -> bytes:
    """One server-sent event carrying ``data`` (a dict as compact JSON, or a literal such as [DONE])."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
