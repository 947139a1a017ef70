"""Shared pieces of the benchmarks: machine description, statistics, JSON output, tables.

Torch is imported only by the functions that use it, so the command-line parsers stay torch-free.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
from pathlib import Path


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def machine() -> dict:
    import torch

    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu_count": os.cpu_count(), "cpus_usable": cpus_usable()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    else:
        info["gpu"], info["gpu_count"] = None, 0
    return info


def cpus_usable(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> float:
    """CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (a container's
    ``cpu.max``), which ``os.cpu_count()`` does not see; a host-bound run is limited by this."""
    n = float(len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else float(os.cpu_count() or 1)
    try:
        quota, period = Path(cpu_max).read_text().split()[:2]
        if quota != "max":
            n = min(n, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return n


def summary(xs: list[float]) -> dict:
    """mean, median and p99 of a list of seconds."""
    if not xs:
        return {"mean": None, "median": None, "p99": None, "n": 0}
    s = sorted(xs)
    p99 = s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]
    return {"mean": statistics.fmean(s), "median": statistics.median(s), "p99": p99, "n": len(s)}


def write_json(path: str | Path, data: dict) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return p


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for h in header:
        t.add_column(h)
    for r in rows:
        t.add_row(*[f"{x:.4g}" if isinstance(x, float) else str(x) for x in r])
    Console(width=160).print(t)


def sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
