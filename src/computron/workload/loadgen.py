"""``computron loadgen``: replay a workload against a running OpenAI-compatible server, open loop.

Each request of the trace is sent at its arrival time (relative to the start), whatever is still
in flight, as a streamed completion: the prompt as token ids (``prompt_tokens`` of them, so its
length is exact whatever the tokenizer), ``max_tokens`` = the trace's output tokens, greedy,
``ignore_eos`` (the server's extension: every request makes exactly its output tokens), usage
included. Per request it records, on this process's clock: the send time, the first streamed text
(the first chunk that reports a token: time to first token), the end, the completion tokens the
server counted, and the HTTP status and error of a failure; and the server's swap counters
(/metrics) over the replay. Time per output token is (end − first token) / (tokens − 1).

The SLO's base is ``--slo-ms``, or each model's solo latency: before the workload, one warm-up
request and then one request of the model's median prompt and output lengths, sent alone.
A progress bar runs while it replays; a summary table, a JSON file and (``--plots``) a latency CDF
per model and the SLO-attainment curve come out. Imports no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass

PROMPT_IDS = tuple(range(32, 127))  # printable ASCII byte ids: valid in every preset's vocabulary


@dataclass
class LoadRecord:
    id: int
    model: str
    arrival: float  # seconds from the start (when it was sent)
    prompt_tokens: int
    output_tokens: int  # what the trace asked for
    first_token: float | None = None
    finish: float | None = None
    completion_tokens: int | None = None  # what the server's usage says it made
    status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish is not None


def prompt_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids, varied by ``seed`` so that requests share no prefix."""
    k = len(PROMPT_IDS)
    return [PROMPT_IDS[(seed * 7919 + i * 31) % k] for i in range(n)]


async def _one(client, url: str, headers: dict, rec: LoadRecord, t0: float) -> None:
    body = {"model": rec.model, "prompt": prompt_ids(rec.prompt_tokens, rec.id), "max_tokens": rec.output_tokens,
            "temperature": 0.0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                return
            async for line in resp.aiter_lines():  # read to its end: a response read whole leaves its
                if not line.startswith("data: "):    # connection to the next request
                    continue
                data = line[6:]
                if data == "[DONE]":
                    continue
                msg = json.loads(data)
                if "error" in msg:
                    rec.error = f"stream error: {msg['error'].get('message', msg['error'])}"
                    return
                if msg.get("usage"):
                    rec.completion_tokens = msg["usage"].get("completion_tokens")
                if rec.first_token is None and any(c.get("text") or c.get("finish_reason") is None
                                                   for c in msg.get("choices") or ()):
                    rec.first_token = time.perf_counter() - t0  # the server sends a chunk per new token
        rec.finish = time.perf_counter() - t0
        if rec.first_token is None:  # no text at all (tokens that decode to nothing): the end is the first
            rec.first_token = rec.finish
    except Exception as e:  # noqa: BLE001 -- every failure is a record, never a crash of the replay
        rec.error = f"{type(e).__name__}: {e}"


def async_client(timeout: float = 600.0):
    """The HTTP client a replay sends with: no cap on connections, up to 256 kept alive, each for 4 s
    idle: under the 5 s after which many servers (uvicorn's default) close one, so that the client
    drops it first instead of sending a request on a connection the server is closing."""
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                                 keepalive_expiry=4.0))


async def replay(url: str, trace, api_key: str | None = None, timeout: float = 600.0,
                 on_done=None, client=None) -> list[LoadRecord]:
    """Send every request of ``trace`` at its time; return one record per request, in trace order.
    ``client``: an open ``async_client()`` to send with (its connections kept alive from earlier
    replays, and left open); default: one of its own for this replay."""
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    records = [LoadRecord(i, a.model, a.time, a.prompt_tokens, a.output_tokens) for i, a in enumerate(trace)]
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(async_client(timeout))
        t0 = time.perf_counter()

        async def fire(rec: LoadRecord) -> None:
            delay = rec.arrival - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            rec.arrival = time.perf_counter() - t0  # when it really left (late if the client fell behind)
            await _one(client, url, headers, rec, t0)
            if on_done:
                on_done(rec)

        await asyncio.gather(*(fire(r) for r in records))
    return records


def _check_reachable(url: str) -> None:
    """Refuse at once when nothing answers at ``url`` (else every request would fail in turn)."""
    import httpx

    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=10)
    except httpx.HTTPError as e:
        raise RuntimeError(f"no server answers at {url}: {type(e).__name__}: {e}") from None


def server_counters(url: str, api_key: str | None = None) -> dict[str, float]:
    """The server's swap counters (``computron_model_swaps_total`` and its seconds and bytes, summed
    over models) and its decode-graph captures (``computron_graph_capture*``), to report what the
    server did during a replay; {} when /metrics cannot be read."""
    import httpx

    out: dict[str, float] = {}
    try:
        text = httpx.get(f"{url.rstrip('/')}/metrics", timeout=10,
                         headers={"Authorization": f"Bearer {api_key}"} if api_key else {}).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if line.startswith(("computron_model_swap", "computron_swap_seconds_sum", "computron_graph_capture")):
            name, _, value = line.rpartition(" ")
            key = name.split("{")[0]
            try:
                out[key] = out.get(key, 0.0) + float(value)
            except ValueError:
                pass
    return out


def solo_latency(url: str, trace, api_key: str | None = None) -> dict[str, float]:
    """Each model's latency for its median request, sent alone after one warm-up request."""
    from ..workload.trace import Request

    out = {}
    for model in sorted({a.model for a in trace}):
        mine = [a for a in trace if a.model == model]
        p = sorted(a.prompt_tokens for a in mine)[len(mine) // 2]
        o = sorted(a.output_tokens for a in mine)[len(mine) // 2]
        asyncio.run(replay(url, [Request(0.0, model, p, 2)], api_key))  # warm-up: the model swaps in
        probe = asyncio.run(replay(url, [Request(0.0, model, p, o)], api_key))[0]
        if probe.ok:
            out[model] = probe.finish - probe.arrival
        else:  # its requests will fail too: they count as missed
            print(f"computron loadgen: no solo latency for {model!r}: {probe.error}", file=sys.stderr)
    return out


def add_parser(sub) -> None:
    from .args import add_workload_args

    p = sub.add_parser("loadgen", help="replay a workload against a running server, open loop, streamed",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--models", default=None, help="comma-separated model names as the server knows them "
                                                  "(default with --trace: the trace's)")
    add_workload_args(p)
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--out", default="bench/results/loadgen.json", help="JSON output")
    p.set_defaults(func=main)


def main(args) -> int:
    from ..bench.common import write_json
    from .args import slo_report, workload_from_args
    from .report import by_model, print_summary

    try:
        names = [m.strip() for m in (args.models or "").split(",") if m.strip()]
        if not names and not args.trace:
            raise ValueError("give --models (the names the server serves) or --trace")
        if not names:
            from .trace import Trace

            names = sorted(set(Trace.read_jsonl(args.trace).models))
        trace = workload_from_args(args, names)
        if not len(trace):
            raise ValueError("the workload has no request")
        _check_reachable(args.url)
        base = args.slo_ms / 1e3 if args.slo_ms else solo_latency(args.url, trace, args.api_key)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"computron loadgen: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("replaying"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[errors]} errors"),
                  TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task("replay", total=len(trace), errors=0)
        errors = [0]

        def done(rec):
            errors[0] += rec.error is not None
            bar.update(task, advance=1, errors=errors[0])

        before = server_counters(args.url, args.api_key)
        t0 = time.perf_counter()
        records = asyncio.run(replay(args.url, trace, args.api_key, args.timeout, done))
        wall = time.perf_counter() - t0
        after = server_counters(args.url, args.api_key)
    summary = by_model(records)
    summary["server"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
    summary["slo"] = slo_report(records, base, args, "loadgen")
    summary["wall_s"] = wall
    write_json(args.out, {"settings": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")},
                          "summary": summary, "records": [asdict(r) for r in records]})
    print_summary(f"loadgen: {len(records)} requests in {wall:.1f} s", summary, summary["slo"])
    errs = sorted({r.error for r in records if r.error})
    for e in errs[:5]:
        print(f"error: {e}", file=sys.stderr)
    print(f"wrote {args.out}" + (f" and plots under {args.plots}" if args.plots else ""))
    return 1 if errs else 0
