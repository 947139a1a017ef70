"""Importers for public trace formats.

- `read_azure_csv(path)`: the Azure LLM-inference trace layout (columns TIMESTAMP,
  ContextTokens, GeneratedTokens; timestamps like "2023-11-16 18:15:46.6805900"). Gives a
  `Trace` for one model, times in seconds relative to the earliest timestamp (the first row of
  a sorted file). Fractional seconds may have any number of digits (kept to the nanosecond).
- `read_sharegpt(path, tokenizer)`: a ShareGPT-style JSON list of
  {"conversations": [{"from": "human"|"gpt", "value": text}, ...]}. Gives (prompt, output)
  token-count pairs, one per human turn immediately followed by a gpt turn, counted as
  len(tokenizer(text)) (default: whitespace split). Feed them to `lengths.Pairs`.

Malformed input raises `trace.TraceFormatError` naming the file and the line (CSV) or the
entry index (JSON).
"""

from __future__ import annotations

import csv
import json
import os
import re
from datetime import datetime, timedelta, timezone
from typing import Callable, Sequence

from .trace import Request, Trace, TraceFormatError

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_TS = re.compile(r"^\s*(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?\s*$")

HUMAN_ROLES = frozenset({"human", "user"})
GPT_ROLES = frozenset({"gpt", "chatgpt", "assistant"})


def parse_timestamp_ns(text: str) -> int:
    """Nanoseconds since the epoch of 'YYYY-MM-DD HH:MM:SS[.fraction][Z|±HH:MM]' (naive = UTC)."""
    m = _TS.match(text)
    if not m:
        raise ValueError(f"bad timestamp {text!r}")
    date, clock, frac, tz = m.groups()
    tzinfo = timezone.utc
    if tz and tz != "Z":
        tz = tz.replace(":", "")
        sign = 1 if tz[0] == "+" else -1
        tzinfo = timezone(sign * timedelta(hours=int(tz[1:3]), minutes=int(tz[3:5])))
    base = datetime.strptime(f"{date} {clock}", "%Y-%m-%d %H:%M:%S").replace(tzinfo=tzinfo)
    ns = int((frac or "0")[:9].ljust(9, "0"))
    return int(base.timestamp()) * 1_000_000_000 + ns


def read_azure_csv(path: str | os.PathLike, model: str = "azure", limit: int | None = None) -> Trace:
    """The Azure LLM-inference trace CSV as a Trace for `model` (first `limit` rows if given)."""
    rows: list[tuple[int, int, int]] = []
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in (reader.fieldnames or [])]
        missing = [c for c in AZURE_COLUMNS if c not in header]
        if missing:
            raise TraceFormatError(f"{path}:1: missing column(s) {', '.join(missing)} (have {header})")
        reader.fieldnames = header
        for row in reader:
            if limit is not None and len(rows) >= limit:
                break
            where = f"{path}:{reader.line_num}"
            try:
                ts = parse_timestamp_ns(row["TIMESTAMP"] or "")
                p, o = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (ValueError, TypeError) as e:
                raise TraceFormatError(f"{where}: {e}") from None
            if p < 0 or o < 0:
                raise TraceFormatError(f"{where}: token counts must be >= 0, got {p}, {o}")
            rows.append((ts, p, o))
    if not rows:
        return Trace([])
    t0 = min(r[0] for r in rows)
    return Trace([Request((ts - t0) / 1e9, model, p, o) for ts, p, o in rows])


def _count(tokenizer: Callable, text: str) -> int:
    out = tokenizer(text)
    return out if isinstance(out, int) else len(out)


def sharegpt_pairs(data: Sequence, tokenizer: Callable | None = None,
                   source: str = "<sharegpt>") -> list[tuple[int, int]]:
    """(prompt, output) token counts from parsed ShareGPT data (see the module docstring)."""
    tok = tokenizer or str.split
    if not isinstance(data, list):
        raise TraceFormatError(f"{source}: expected a JSON list of conversations")
    pairs: list[tuple[int, int]] = []
    for i, entry in enumerate(data):
        where = f"{source}: entry {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
            raise TraceFormatError(f"{where}: expected an object with a 'conversations' list")
        turns = entry["conversations"]
        for j, turn in enumerate(turns):
            if not isinstance(turn, dict) or "from" not in turn or not isinstance(turn.get("value"), str):
                raise TraceFormatError(f"{where}, turn {j}: expected {{'from': .., 'value': text}}")
        for a, b in zip(turns, turns[1:]):
            if a["from"] in HUMAN_ROLES and b["from"] in GPT_ROLES:
                pairs.append((_count(tok, a["value"]), _count(tok, b["value"])))
    return pairs


def read_sharegpt(path: str | os.PathLike, tokenizer: Callable | None = None) -> list[tuple[int, int]]:
    """(prompt, output) token-count pairs from a ShareGPT-style JSON file."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    return sharegpt_pairs(data, tokenizer, source=str(path))
