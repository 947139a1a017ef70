"""Where a training job's time goes, over a window of steps: ``computron train --profile DIR``.

A window of ``--profile-steps`` optimizer steps runs under ``torch.profiler`` when the job reaches
step ``--profile-at``, or whenever another process asks for one by writing ``DIR/request`` (its
text: how many steps, or empty for the default). That is how ``bench/hybrid.py --profile-job``
profiles the same job alone and beside a server, mid-run. Each window writes
``DIR/profile_<rank>_<k>.json``:

- ``wall_s``: the window's seconds, first step's start to last step's end (``start_unix``,
  ``end_unix``: when, on the machine's clock, for a reader in another process);
- ``device_busy_s``: on a GPU, the union of this process's kernel and copy intervals (the time the
  GPU worked for the job, whatever ran beside it), and ``device_kernel_s``, their sum (more than the
  union when its streams overlap); ``device_busy_share`` = busy / wall; ``host_self_s``: the host
  operators' own time (launches included), all threads of the process. Beside an inference server,
  the job's kernels taking longer than alone means the two share the GPU's SMs; the same kernel
  time over a longer wall means the job waited (for memory, for the host, or for its turn);
- ``top_device``: the kernels taking the most device time; ``top_host``: the host-side operators
  taking the most self time (both with counts);
- with ``--profile-trace``, ``trace_<rank>_<k>.json``, the window's timeline for chrome://tracing
  or Perfetto;
- ``post_s``: the seconds the profiler's own work took after the window (collecting and summarising
  its events, on the training thread: the job trains none of that time; several seconds for a GPU
  job's window of thousands of kernels).

The request file is looked at between steps (one ``stat`` a step); nothing is profiled otherwise.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

REQUEST = "request"


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by (start, end) intervals in microseconds."""
    total, end = 0.0, -1.0
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e6


def summarize(prof, steps: int, wall_s: float, top: int = 15) -> dict:
    """The window's figures from a finished ``torch.profiler.profile``."""
    from torch.autograd import DeviceType

    device, host = [], {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            device.append(e)
        elif e.device_type == DeviceType.CPU:
            h = host.setdefault(e.name, [0, 0.0])
            h[0] += 1
            h[1] += e.self_cpu_time_total / 1e6
    intervals = [(e.time_range.start, e.time_range.end) for e in device]
    busy = union_s(intervals)
    kernels: dict[str, list] = {}
    for e in device:
        k = kernels.setdefault(e.name, [0, 0.0])
        k[0] += 1
        k[1] += (e.time_range.end - e.time_range.start) / 1e6
    rank = lambda d: sorted(d.items(), key=lambda kv: -kv[1][1])[:top]  # noqa: E731
    return {"steps": steps, "wall_s": wall_s, "wall_s_per_step": wall_s / steps,
            "device_busy_s": busy, "device_kernel_s": sum(v[1] for v in kernels.values()),
            "device_busy_share": busy / wall_s if device else None, "device_events": len(device),
            "host_self_s": sum(v[1] for v in host.values()),
            "top_device": [{"name": n, "calls": c, "s": s} for n, (c, s) in rank(kernels)],
            "top_host": [{"name": n, "calls": c, "self_s": s} for n, (c, s) in rank(host)]}


class StepProfiler:
    """Profiles windows of steps of one process (``rank``) into ``out``; ``before``/``after`` go around
    every step."""

    def __init__(self, out: str | Path, at: int | None = None, steps: int = 3, cuda: bool = False,
                 trace: bool = False, rank: int = 0, log=None):
        if steps < 1:
            raise ValueError(f"a profile window needs at least one step, got {steps}")
        if at is not None and at < 1:
            raise ValueError(f"--profile-at counts steps from 1, got {at}")
        self.dir = Path(out)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.at, self.steps, self.cuda, self.trace, self.rank = at, steps, cuda, trace, rank
        self.log = log or (lambda s: None)
        self.windows = 0
        self._prof = None
        self._left = 0
        self._t0 = 0.0

    def _asked(self, step: int) -> int:
        """Steps to profile from ``step`` (1-based) on: 0 when nobody asked."""
        if step == self.at:
            return self.steps
        req = self.dir / REQUEST
        if not req.exists():
            return 0
        try:
            text = req.read_text().strip()
            os.unlink(req)
        except OSError:  # another rank took it first, or it is being written: next step
            return 0
        try:
            n = int(text) if text else self.steps
        except ValueError:
            self.log(f"profile: {req} holds {text!r}, not a number of steps; profiling {self.steps}")
            n = self.steps
        return max(1, n)

    def before(self, step: int) -> None:
        if self._prof is not None:
            return
        n = self._asked(step)
        if not n:
            return
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._prof = torch.profiler.profile(activities=acts)
        self._prof.__enter__()
        self._left, self._n, self._t0, self._unix0 = n, n, time.perf_counter(), time.time()

    def after(self, step: int) -> None:
        if self._prof is None:
            return
        self._left -= 1
        if self._left:
            return
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        end = time.perf_counter()
        wall = end - self._t0
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        k = self.windows
        self.windows += 1
        out = summarize(prof, self._n, wall)
        if self.trace:
            prof.export_chrome_trace(str(self.dir / f"trace_{self.rank}_{k}.json"))
        # the profiler's own work after the window (seconds of it, on this thread, for a GPU's
        # thousands of kernels): the job trains none of that time, which a rate taken over a run must leave out
        out.update(rank=self.rank, window=k, last_step=step, start_unix=self._unix0, end_unix=self._unix0 + wall,
                   post_s=time.perf_counter() - end)
        path = self.dir / f"profile_{self.rank}_{k}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        os.replace(tmp, path)  # whole or absent for a reader polling the folder
        busy = f", device busy {out['device_busy_share']:.0%}" if out["device_busy_share"] is not None else ""
        self.log(f"profile: steps {step - self._n + 1}-{step}, {wall / self._n * 1e3:.1f} ms a step{busy} -> {path}")

    def close(self) -> None:
        """End a window cut short (the job ended inside it): nothing is written."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
