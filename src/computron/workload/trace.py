"""Requests and traces, and their JSONL form.

A `Request` is one arrival: time in seconds from the start of the trace, the model it asks for,
and its prompt and output lengths in tokens. A `Trace` is a list of requests sorted by time
(stable: requests at the same time keep the order they were given in). Generators
(`make.make_workload`) and importers (`importers`) produce traces; a simulator or a load
generator consumes them.

JSONL: one JSON object per line, ``{"time": .., "model": .., "prompt_tokens": .., "output_tokens": ..}``.
Blank lines are skipped and extra keys ignored; anything else that is not a valid request raises
`TraceFormatError` naming the file and line. Times are written with Python's float repr, so a
trace written and read back compares equal.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import IO, Iterable, Iterator

FIELDS = ("time", "model", "prompt_tokens", "output_tokens")


class TraceFormatError(ValueError):
    """A trace file (JSONL, CSV or JSON) that cannot be read; the message names where."""


@dataclass(frozen=True)
class Request:
    """One arrival: `time` seconds after the trace starts, for `model`, with token counts."""

    time: float
    model: str
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self):
        problem = _check(self.time, self.model, self.prompt_tokens, self.output_tokens)
        if problem:
            raise ValueError(problem)

    def to_dict(self) -> dict:
        return {"time": self.time, "model": self.model,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(time, model, prompt_tokens, output_tokens) -> str | None:
    """The first thing wrong with these fields, or None."""
    if not isinstance(time, (int, float)) or isinstance(time, bool):
        return f"time must be a number, got {time!r}"
    if not math.isfinite(time):
        return f"time must be finite, got {time!r}"
    if time < 0:
        return f"time must be >= 0, got {time!r}"
    if not isinstance(model, str) or not model:
        return f"model must be a non-empty string, got {model!r}"
    for name, v in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
        if not _is_int(v):
            return f"{name} must be an integer, got {v!r}"
        if v < 0:
            return f"{name} must be >= 0, got {v!r}"
    return None


@dataclass
class Trace:
    """Requests sorted by arrival time."""

    requests: list[Request] = field(default_factory=list)

    def __post_init__(self):
        self.requests = sorted(self.requests, key=lambda r: r.time)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __getitem__(self, i):
        return self.requests[i]

    @property
    def models(self) -> list[str]:
        """Model names in order of first appearance."""
        return list(dict.fromkeys(r.model for r in self.requests))

    def counts(self) -> dict[str, int]:
        """Requests per model."""
        out: dict[str, int] = {}
        for r in self.requests:
            out[r.model] = out.get(r.model, 0) + 1
        return out

    def times(self, model: str | None = None) -> list[float]:
        return [r.time for r in self.requests if model is None or r.model == model]

    def pairs(self) -> list[tuple[int, int]]:
        """(prompt_tokens, output_tokens) of every request, for `lengths.Pairs`."""
        return [(r.prompt_tokens, r.output_tokens) for r in self.requests]

    # JSONL -----------------------------------------------------------------------------------

    def write_jsonl(self, f: str | os.PathLike | IO[str]) -> None:
        if isinstance(f, (str, os.PathLike)):
            with open(f, "w", encoding="utf-8") as fh:
                self.write_jsonl(fh)
            return
        for r in self.requests:
            f.write(json.dumps(r.to_dict()) + "\n")

    def dumps(self) -> str:
        return "".join(json.dumps(r.to_dict()) + "\n" for r in self.requests)

    @classmethod
    def read_jsonl(cls, f: str | os.PathLike | IO[str]) -> "Trace":
        if isinstance(f, (str, os.PathLike)):
            with open(f, encoding="utf-8") as fh:
                return cls(list(parse_jsonl(fh, source=str(f))))
        return cls(list(parse_jsonl(f, source=getattr(f, "name", "<stream>"))))

    @classmethod
    def loads(cls, text: str, source: str = "<string>") -> "Trace":
        return cls(list(parse_jsonl(text.splitlines(), source=source)))


def parse_jsonl(lines: Iterable[str], source: str = "<jsonl>") -> Iterator[Request]:
    """Requests from JSONL lines; `TraceFormatError` names `source` and the 1-based line."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in FIELDS if k not in obj]
        if missing:
            raise TraceFormatError(f"{where}: missing field(s) {', '.join(missing)}")
        problem = _check(obj["time"], obj["model"], obj["prompt_tokens"], obj["output_tokens"])
        if problem:
            raise TraceFormatError(f"{where}: {problem}")
        yield Request(float(obj["time"]), obj["model"], obj["prompt_tokens"], obj["output_tokens"])
