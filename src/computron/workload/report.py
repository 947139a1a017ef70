"""What users judge a server by, from per-request records: latency, time to first token (TTFT),
time per output token (TPOT), SLO attainment, and the plots of them. Shared by ``computron
loadgen`` (measured) and ``computron sim`` (simulated), so both speak the same numbers.

A record is any object with ``model``, ``arrival``, ``first_token``, ``finish`` (absolute seconds,
None when it never came), ``output_tokens`` and ``ok`` (it completed without an error).

SLO attainment at scale k: the share of requests that completed with a latency of at most k times
their model's base SLO (a solo latency, or a fixed number of milliseconds). Failed requests count
as missed. No torch here; matplotlib only when a plot is drawn.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Mapping, Sequence

SCALES = tuple(range(1, 11))  # SLO multiples the attainment curve is drawn at


def percentile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), ``q`` in [0, 100]."""
    if not sorted_xs:
        return math.nan
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def stats(xs: Iterable[float]) -> dict:
    xs = sorted(xs)
    return {"mean": sum(xs) / len(xs) if xs else math.nan, "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "p99": percentile(xs, 99), "max": xs[-1] if xs else math.nan}


def latency(r) -> float | None:
    return None if r.finish is None else r.finish - r.arrival


def ttft(r) -> float | None:
    return None if r.first_token is None else r.first_token - r.arrival


def tpot(r) -> float | None:
    """Seconds per output token after the first; None for a request of one token."""
    if r.finish is None or r.first_token is None or r.output_tokens < 2:
        return None
    return (r.finish - r.first_token) / (r.output_tokens - 1)


def summarize(records: Sequence) -> dict:
    ok = [r for r in records if r.ok]
    return {"requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
            "latency": stats(latency(r) for r in ok), "ttft": stats(ttft(r) for r in ok),
            "tpot": stats(x for x in (tpot(r) for r in ok) if x is not None),
            "output_tokens": sum(r.output_tokens for r in ok)}


def by_model(records: Sequence) -> dict:
    """{"all": summary, "models": {model: summary}}."""
    out = {"all": summarize(records), "models": {}}
    for name in sorted({r.model for r in records}):
        out["models"][name] = summarize([r for r in records if r.model == name])
    return out


def attainment(records: Sequence, base: Mapping[str, float] | float, scales: Sequence[float] = SCALES) -> dict:
    """Share of requests within k × their model's base SLO (seconds), per model and over all; a
    request that failed, or whose model has no base, misses."""
    def curve(rs):
        lat = []
        for r in rs:
            b = base if isinstance(base, (int, float)) else base.get(r.model)
            lat.append(latency(r) / b if b and r.ok and r.finish is not None else math.inf)
        return [sum(x <= k for x in lat) / len(lat) if lat else math.nan for k in scales]

    out = {"scales": list(scales), "all": curve(records), "models": {}}
    for name in sorted({r.model for r in records}):
        out["models"][name] = curve([r for r in records if r.model == name])
    return out


def print_summary(title: str, summary: dict, slo: dict | None = None) -> None:
    """A table in milliseconds: per model and over all."""
    from ..bench.common import print_table

    ms = lambda x: f"{x * 1e3:.1f}" if x == x else "-"  # noqa: E731  (NaN prints as -)
    rows = []
    for name, s in [*summary["models"].items(), ("all", summary["all"])]:
        lat, first, per = s["latency"], s["ttft"], s["tpot"]
        row = [name, s["requests"], s["completed"], s["failed"], ms(lat["mean"]), ms(lat["p50"]), ms(lat["p99"]),
               ms(first["p50"]), ms(first["p99"]), ms(per["p50"])]
        if slo is not None:
            curve = slo["all"] if name == "all" else slo["models"][name]
            at = slo["scales"].index(slo["report_scale"]) if slo.get("report_scale") in slo["scales"] else 0
            row.append(f"{curve[at] * 100:.1f}%")
        rows.append(row)
    header = ["model", "requests", "done", "failed", "latency mean", "p50", "p99", "TTFT p50", "TTFT p99", "TPOT p50"]
    if slo is not None:
        header.append(f"SLO x{slo.get('report_scale', slo['scales'][0])}")
    print_table(title + " (ms)", header, rows)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdf(records: Sequence, path: str | Path, title: str = "latency") -> Path:
    """Latency CDF per model (completed requests), seconds on a log axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in sorted({r.model for r in records}):
        xs = sorted(latency(r) for r in records if r.model == name and r.ok and r.finish is not None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xscale("log")
    return _save(plt, fig, ax, path, "latency (s)", "share of requests", title)


def plot_curves(curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], path: str | Path, xlabel: str,
                title: str, ylabel: str = "SLO attainment") -> Path:
    """One line per label: (x values, attainment in [0, 1]). For attainment against the SLO scale,
    and for a sweep (against rate, CV or budget) with one line per policy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, (xs, ys) in curves.items():
        ax.plot(list(xs), [y * 100 for y in ys], marker="o", label=label)
    ax.set_ylim(0, 101)
    return _save(plt, fig, ax, path, xlabel, ylabel + " (%)", title)


def _save(plt, fig, ax, path, xlabel: str, ylabel: str, title: str) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p


def plot_attainment(slo: dict, path: str | Path, title: str = "SLO attainment") -> Path:
    curves = {name: (slo["scales"], ys) for name, ys in slo["models"].items()}
    curves["all"] = (slo["scales"], slo["all"])
    return plot_curves(curves, path, "SLO scale (× base SLO)", title)
