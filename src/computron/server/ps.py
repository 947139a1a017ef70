"""``computron ps``: the models of a running server and where each lives, as a table (like ``ollama ps``)."""

from __future__ import annotations

import json
import os
import sys

import httpx

from ..config import format_bytes


def fetch(url: str, api_key: str | None = None, timeout: float = 10.0) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout)
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except Exception:
            message = r.text[:200]
        raise RuntimeError(f"{r.status_code}: {message}")
    return r.json()


def render(data: dict, file=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    for col, justify in (("NAME", "left"), ("STATE", "left"), ("SIZE", "right"), ("PINNED", "left"),
                         ("QUEUE", "right"), ("RUNNING", "right"), ("PARALLEL", "left"), ("SOURCE", "left")):
        table.add_column(col, justify=justify, no_wrap=col != "SOURCE")
    colour = {"resident": "green", "loading": "yellow", "offloaded": "dim"}
    for m in data.get("data", []):
        par = m.get("parallel") or {}
        state = m.get("state", "?")
        table.add_row(escape(str(m["id"])), f"[{colour.get(state, 'white')}]{state}[/]", format_bytes(int(m.get("bytes", 0))),
                      "yes" if m.get("pinned") else "", str(m.get("queue", "")), str(m.get("running", "")),
                      " ".join(f"{k}={par[k]}" for k in ("dp", "tp", "pp") if k in par), escape(str(m.get("source", ""))))
    console = Console(file=file)
    if not console.is_terminal:  # piped: do not cut the table at 80 columns
        console.width = 200
    console.print(table)
    mem = data.get("memory")
    if mem:
        console.print(f"device memory: weights {format_bytes(mem['weights'])}, KV cache {format_bytes(mem['kv'])}, "
                      f"budget {format_bytes(mem['budget'])}")


def ps_main(args) -> int:
    key = args.api_key or os.environ.get("COMPUTRON_API_KEY")
    try:
        data = fetch(args.url, key)
    except httpx.HTTPError as e:
        print(f"computron ps: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        print(f"computron ps: {args.url} answered {e}", file=sys.stderr)
        return 1
    if getattr(args, "json", False):
        print(json.dumps(data, indent=2))
    else:
        render(data)
    return 0
