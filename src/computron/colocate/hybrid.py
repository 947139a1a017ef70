"""Hybrid benchmark: a bursty inference workload against a training job on the same GPU, per mode.

The inference side is the real server: one ``computron serve`` process with ``--models`` copies of
a preset (``--preset``, default OPT-1.3B: ``opt-1.3b=a``, ``opt-1.3b=b``, ...), opened with
``--colocate ADDRESS`` so that its engine asks the memory arbiter for memory before its steps
(``colocate/serving.py``). One trace (``computron.workload.make_workload``: Gamma arrivals at
``--rate`` with ``--cv``, ``--duration`` seconds, uniformly over the models, ``--prompt`` and
``--output`` tokens) is replayed identically, open loop and streamed (``computron loadgen``'s
``replay``), for inference alone, training alone and the trainer colocated in each of the arbiter's
modes (normal, static, task-switch, colocate) and in colocate with the job yielding the GPU's compute
(``colocate+yield``: while inference has work; ``colocate+yield-first``: while a request waits for its
first token), each ``--repeats`` times; on request also ``colocate+yield-cold`` (while a request that
found its model off the GPU waits for its first token) and ``static`` with each yield. The training job runs in
its own process: ``--job gpt`` is ``computron train`` (a GPT-2-medium shape by default, or
``--train-model``), ``--job resnet`` is ``examples/resnet_colocated.py`` (ResNet-50, SGD).

Start-up is paid once: one serve process serves every run (inference alone under a ``normal``
arbiter that no job joins; then the bench switches its mode, ``POST /admin/colocation``); one job
process runs every training-alone run and another, started under the first mode and reconnecting
to each next arbiter, every colocated run; repeats go round the modes. Each run starts with every
model offloaded and, under an arbiter, once the shares settled to the mode's start (training holds
what it may) and the job made a step. Each start-up part is timed and reported, the server's
warm-up (the trace replayed once, unrecorded) included.

Reports per phase (medians over repeats): SLO attainment at k x solo latency (k = 1..8; solo: each
model's median latency in inference alone), and at 5x over all the repeats' requests with its 95%
interval (``slo_pooled``), p50/p99 latency and time to first token, training
samples/s relative to training alone, the handovers (``GET /colocation`` of the server: each
demand that took training's memory) split into signal, training release, ack, inference
allocation (the arena mapping the memory again) and swap-in, how often training was told to
shrink and to yield, and a PNG timeline of memory by owner (with the yields). Writes
bench/results/hybrid_<tag>.json (and .png). A run that fails (a job or the server that stops or stalls)
ends the call: the summary still holds every run before it, with the failure in ``failed``, and the
exit status is 1.
With ``--profile-job N`` the job (``--job gpt``) profiles N of its steps in every run, a third of the
way in (``computron train --profile``): its step time, its host operators' time and, on a GPU, its
kernels' time and the share of the window the GPU worked for it (``job_*`` in each row; the whole
window in the run's ``job_profile``): whether the job beside inference runs slower kernels (sharing
the SMs) or the same kernels with gaps between them.

    computron bench hybrid --duration 10 --repeats 2 --job-timeout 120 --fresh --tag h100_engine
    computron bench hybrid --job resnet --duration 10 --repeats 2 --fresh --tag h100_engine_resnet

(``python bench/hybrid.py`` runs the same, for the scripts and results that name it.)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import httpx
import numpy as np

from computron.colocate.arbiter import MODES
from computron.colocate.hybrid_cli import DESCRIPTION, JOBS, REFERENCES, RESULTS, arguments
from computron.server.background import free_port
from computron.workload.loadgen import replay, server_counters
from computron.workload.make import make_workload

GB = 1 << 30
SRC = Path(__file__).resolve().parents[2]  # the directory that holds the computron package (a checkout's src)
EXAMPLES = SRC.parent / "examples"  # a checkout's examples (--job resnet)
ADMIN_KEY = "hybrid-bench"


def gpt2_medium_checkpoint(path: Path) -> str:
    """A GPT-2-medium-shaped checkpoint with random weights (the presets stop at gpt2-small)."""
    import torch

    from computron.memory.host import HostImage
    from computron.memory.layout import WeightLayout
    from computron.models import ModelConfig, save_checkpoint
    from computron.models.transformer import DecoderLM

    if (path / "config.json").is_file():
        return str(path)
    cfg = ModelConfig(name="gpt2-medium", family="gpt2", vocab_size=50257, hidden_size=1024, num_layers=24,
                      num_heads=16, ffn_size=4096, max_position=1024, activation="gelu_new", dtype="float32",
                      bos_token_id=50256, eos_token_id=50256)
    image = HostImage(WeightLayout.of(DecoderLM(cfg), torch.float32), pin=False)
    image.fill_random(cfg, 0, "cuda" if torch.cuda.is_available() else "cpu")
    save_checkpoint(path, cfg, image.views)
    return str(path)


def job_command(args, ckpt: str | None, addr: str | None, profile: Path | None = None) -> list[str]:
    """The training job's command line (``--job``), colocated under ``addr`` when given; ``profile``:
    its ``--profile`` folder (``--job gpt``; windows asked for by ``run_phase``)."""
    if args.job == "resnet":
        cmd = [sys.executable, str(EXAMPLES / "resnet_colocated.py"), "--steps", "1000000",
               "--device", args.device]
        cmd += ["--colocate", addr, "--run-ahead", str(args.run_ahead)] if addr else []
    else:
        cmd = [sys.executable, "-m", "computron.cli", "train", "--model", ckpt, "--steps", "1000000",
               "--seq-len", str(args.seq_len), "--device", args.device]
        cmd += ["--colocate", addr, "--colocate-run-ahead", str(args.run_ahead)] if addr else []
        if profile is not None:
            cmd += ["--profile", str(profile), "--profile-steps", str(args.profile_job)]
    return cmd + ["--global-batch", str(args.global_batch), "--micro-batch", str(args.micro_batch),
                  *shlex.split(args.train_args)]


def profile_dir(args, addr: str | None) -> Path:
    """Where the job alone (``addr`` None) or the colocated job writes its step profiles."""
    return Path(args.profile_root) / ("colocated" if addr else "alone")


def ask_profile(job: "Job", after_s: float) -> threading.Timer:
    """Ask the job for a window of profiled steps ``after_s`` seconds from now (train/profile.py)."""
    def ask():
        (job.profile / "request").write_text("")
    t = threading.Timer(after_s, ask)
    t.daemon = True
    t.start()
    return t


def take_profile(job: "Job", before: set[str], run: tuple[float, float], timeout_s: float,
                 top: int = 5) -> dict | None:
    """The window the job wrote since ``before`` (the files there then), waiting up to ``timeout_s``
    (a job paused by the arbiter takes the request only when it steps again); ``inside_run``: whether
    the window lay within ``run`` (its start and end, ``time.time()``); its ``top`` costliest kernels and
    host calls. None, and the request taken back, when none came."""
    deadline = time.monotonic() + timeout_s
    while True:
        new = sorted(set(p.name for p in job.profile.glob("profile_*.json")) - before)
        if new:
            d = json.loads((job.profile / new[0]).read_text())
            return {**d, "top_device": d["top_device"][:top], "top_host": d["top_host"][:top],
                    "inside_run": run[0] <= d["start_unix"] and d["end_unix"] <= run[1]}
        if time.monotonic() > deadline or job.p.poll() is not None:
            (job.profile / "request").unlink(missing_ok=True)  # not left for the next run to answer
            return None
        time.sleep(0.05)


def model_names(args) -> list[str]:
    """The served names: ``--models`` copies of the preset, aliased a, b, c, ..."""
    return [chr(ord("a") + i) if i < 26 else f"m{i}" for i in range(args.models)]


def serve_command(args, port: int, addr: str) -> list[str]:
    """``computron serve`` with the models, a budget of ``--capacity-gb`` for weights and KV cache (the
    arbiter's capacity) plus ``--workspace-gb``, and the arbiter at ``addr`` (``normal`` to start)."""
    cap, ws = int(args.capacity_gb * GB), int(args.workspace_gb * GB)
    cmd = [sys.executable, "-m", "computron.cli", "serve", "--device", args.device, "--port", str(port),
           "--gpu-memory-budget", str(cap + ws), "--workspace", str(ws), "--admin-key", ADMIN_KEY,
           "--log-level", "warning", "--colocate", addr, "--colocate-mode", "normal",
           "--colocate-idle", str(args.idle), "--colocate-static-train", str(int(args.static_train_gb * GB))]
    cmd += ["--colocate-at-boundary"] if args.at_boundary else []
    for name in model_names(args):
        cmd += ["--model", f"{args.preset}={name}"]
    return cmd + shlex.split(args.serve_args)


def _env(extra: dict[str, str] | None = None) -> dict:
    path = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def env_pairs(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict (``--colocated-job-env``); a string without ``=`` is an error."""
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"--colocated-job-env takes KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


GPU_QUERY = "clocks.sm,temperature.gpu,power.draw"


def parse_gpu_sample(line: str) -> tuple[float, float, float] | None:
    """One line of ``nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader,nounits``: (SM clock MHz,
    temperature C, power W); None for a line that is not three numbers ("[N/A]" where a field is not read)."""
    try:
        sm, temp, power = (float(x) for x in line.split(","))
    except ValueError:
        return None
    return sm, temp, power


class GpuSampler:
    """The GPU's SM clock, temperature and power draw every half second while a run lasts (from
    ``nvidia-smi``, the first visible GPU), to tell a job slowed by the other process from one slowed
    by a GPU that clocks down as it heats. Samples nothing on the CPU or without ``nvidia-smi``."""

    def __init__(self, device: str):
        self.samples: list[tuple[float, float, float, float]] = []  # (seconds from start, MHz, C, W)
        self.p = None
        if not device.startswith("cuda") or not shutil.which("nvidia-smi"):
            return
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits",
                                   "-lms", "500", "-i", visible or "0"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            got = parse_gpu_sample(line)
            if got is not None:
                self.samples.append((time.monotonic() - self.t0, *got))

    def stop(self) -> dict | None:
        """The run's samples and their summary (None when nothing was sampled)."""
        if self.p is not None and self.p.poll() is None:
            self.p.terminate()
            self.p.wait(10)
        return gpu_summary(self.samples)


def gpu_summary(samples: list[tuple[float, float, float, float]]) -> dict | None:
    if not samples:
        return None
    sm, temp, power = (np.array([s[i] for s in samples]) for i in (1, 2, 3))
    return {"sm_clock_mhz_median": float(np.median(sm)), "sm_clock_mhz_min": float(sm.min()),
            "temperature_c_max": float(temp.max()), "power_w_median": float(np.median(power)),
            "samples": [list(s) for s in samples]}


class Proc:
    """A child process whose output is read as it comes (kept for when it fails)."""

    def __init__(self, cmd: list[str], timeout_s: float, name: str, env: dict[str, str] | None = None):
        self.timeout_s, self.name = timeout_s, name  # for its start-up, or settling into a new run
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                  env=_env(env))
        self.last_lines = collections.deque(maxlen=120)  # what it said last, shown if it never gets going
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.last_lines.append(line.rstrip())
            self.line(line)

    def line(self, line: str) -> None:
        if "rror" in line or "Traceback" in line:
            print(f"{self.name}:", line.rstrip(), file=sys.stderr)

    def fail(self, what: str):
        self.stop()
        raise RuntimeError(f"{what}; the {self.name} said last:\n" + "\n".join(self.last_lines))

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


class Job(Proc):
    """The training job's process; its step lines are timed as they come."""

    def __init__(self, cmd: list[str], timeout_s: float = 300.0, profile: Path | None = None,
                 env: dict[str, str] | None = None):
        self.steps: list[float] = []  # when each step line came
        self.micro: list[list[int]] = []  # each step's micro-batch sizes, as its line says
        self.peaks: list[int | None] = []  # each step's peak memory in MiB, as its line says
        self.profile = profile  # its --profile directory (None: not profiled)
        if profile is not None:
            profile.mkdir(parents=True, exist_ok=True)
        super().__init__(cmd, timeout_s, "trainer", env)

    def line(self, line: str) -> None:
        if re.match(r"step (\d+)/", line):
            self.steps.append(time.monotonic())
            sizes = re.search(r"micro-batches \[([\d, ]*)\]", line)
            self.micro.append([int(x) for x in sizes.group(1).split(",") if x.strip()] if sizes else [])
            peak = re.search(r"peak ([\d,]+) MiB", line)
            self.peaks.append(int(peak.group(1).replace(",", "")) if peak else None)
        else:
            super().line(line)

    def wait_steps(self, n: int, after: float, what: str) -> float:
        """Wait for ``n`` steps ending after ``after``; the seconds since the job started."""
        deadline = time.monotonic() + self.timeout_s
        while sum(t > after for t in self.steps) < n:
            if self.p.poll() is not None or time.monotonic() > deadline:
                if self.p.poll() is None:  # stuck: its threads' stacks (the train CLI prints them on SIGUSR1)
                    self.p.send_signal(signal.SIGUSR1)
                    time.sleep(2.0)
                self.fail(f"{what}: the training job made {sum(t > after for t in self.steps)} of {n} steps "
                          f"in {self.timeout_s:.0f} s")
            time.sleep(0.02)
        return time.monotonic() - self.t0

    def samples_per_s(self, t0: float, t1: float, batch: int, skip: tuple[float, float] | None = None) -> float:
        """The rate of samples over ``t0``..``t1``, leaving out ``skip`` (a span of it, its steps and
        its time: the profiled window and the profiler's own work after it)."""
        if skip is None:
            return sum(t0 <= t <= t1 for t in self.steps) * batch / (t1 - t0)
        a, b = max(skip[0], t0), min(skip[1], t1)
        kept = sum(t0 <= t <= t1 and not a <= t <= b for t in self.steps)
        return kept * batch / (t1 - t0 - max(0.0, b - a))

    def micro_batches(self, t0: float, t1: float) -> list[int]:
        """Every micro-batch size of the steps that ended between ``t0`` and ``t1``."""
        return [m for t, sizes in zip(self.steps, self.micro) if t0 <= t <= t1 for m in sizes]

    def peaks_mib(self, t0: float, t1: float) -> list[int | None]:
        """The peak memory (MiB) of each step that ended between ``t0`` and ``t1``."""
        return [p for t, p in zip(self.steps, self.peaks) if t0 <= t <= t1]

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()


class Server(Proc):
    """The ``computron serve`` process, its models, and its colocation records and mode switch."""

    def __init__(self, args, addr: str, timeout_s: float):
        self.args, self.port, self.models = args, free_port(), model_names(args)
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=60.0)
        super().__init__(serve_command(args, self.port, addr), timeout_s, "server")
        deadline = time.monotonic() + timeout_s
        while True:  # ready: every model registered (host images built)
            if self.p.poll() is not None or time.monotonic() > deadline:
                self.fail(f"the server did not get ready in {timeout_s:.0f} s")
            try:
                r = self.http.get("/health")
                if r.status_code == 200:
                    body = r.json()
                    if body["failed"]:
                        self.fail(f"the server could not register {body['failed']}")
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.mode = "normal"

    def admin(self, method: str, path: str, **kw) -> httpx.Response:
        return self.http.request(method, path, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, **kw)

    def report(self, since: float | None = None) -> dict:
        r = self.http.get("/colocation", params={} if since is None else {"since": since})
        r.raise_for_status()
        return r.json()

    def switch(self, phase: str) -> float:
        """The arbiter of ``phase`` (a new one at the same address: the job reconnects); seconds taken."""
        t = time.monotonic()
        r = self.admin("POST", "/admin/colocation", json=arbiter_settings(phase, self.args.static_train_gb))
        if r.status_code != 200:
            self.fail(f"switching to {phase} failed: {r.status_code} {r.text}")
        self.mode = phase
        return time.monotonic() - t

    @staticmethod
    def settled(rep: dict) -> bool:
        """The shares are at the start of a run under the arbiter of ``rep``: ``normal`` books none
        (inference keeps its whole budget unasked), ``static`` gives inference the rest of the split,
        and the other modes are at their idle shares (``Arbiter.settled``)."""
        if rep["mode"] == "normal":
            return True
        if rep["mode"] == "static":
            return rep["shares"][0][0] == rep["capacity"] - rep["static_train"]
        return rep["settled"][0]

    def reset(self, trainer: bool) -> None:
        """Every model offloaded; under an arbiter the shares settled (and the job joined, if ``trainer``)."""
        for name in self.models:
            r = self.admin("POST", f"/admin/models/{name}/offload")
            if r.status_code != 200:
                print(f"offload {name}: {r.status_code} {r.text}", file=sys.stderr)
        deadline = time.monotonic() + self.timeout_s
        while True:
            rep = self.report(time.monotonic())
            if self.settled(rep) and (not trainer or 0 in rep["trainers"]):
                return
            if self.p.poll() is not None or time.monotonic() > deadline:
                self.fail(f"{self.mode}: the shares did not settle (now {rep['shares'][0]} for inference and "
                          f"training, trainers {rep['trainers']}) in {self.timeout_s:.0f} s")
            time.sleep(0.02)

    def stop(self) -> None:
        super().stop()
        self.http.close()


def run_phase(args, phase: str, trace, server: Server | None, job: Job | None) -> dict:
    """One run of ``phase`` over the trace: the workload (if ``server``) against the job (if any)."""
    if server is not None:
        server.reset(trainer=job is not None)
    if job is not None:  # a step under this arbiter (after the reset) before the run
        job.wait_steps(1, time.monotonic(), phase)
    before = server.report(time.monotonic()) if server is not None else None
    profiled = job is not None and job.profile is not None
    if profiled:
        seen = {p.name for p in job.profile.glob("profile_*.json")}
        timer = ask_profile(job, args.duration / 3)  # a window mid-run, where the trace is under way
    t0, unix0 = time.monotonic(), time.time()
    gpu = GpuSampler(args.device)
    swaps0 = server_counters(server.url) if server is not None else {}
    records = asyncio.run(replay(server.url, trace, timeout=args.request_timeout)) if server is not None else []
    while time.monotonic() - t0 < args.duration:
        time.sleep(0.05)
    t1 = time.monotonic()
    gpu_state = gpu.stop()
    profile = None
    if profiled:
        timer.join()
        profile = take_profile(job, seen, (unix0, unix0 + (t1 - t0)), args.job_timeout)
        if profile is None:
            print(f"{phase}: the job wrote no profile", file=sys.stderr)
    # the training rate leaves out the profiled window and the profiler's work after it (the job trains
    # slower under the profiler, and not at all while it collects): on this run's clock
    skip = None if not profile else (t0 + profile["start_unix"] - unix0,
                                     t0 + profile["end_unix"] + profile.get("post_s", 0.0) - unix0)
    out = {"mode": phase, "start": t0, "seconds": t1 - t0,
           "requests": [{"model": r.model, "latency": None if not r.ok else r.finish - r.arrival,
                         "ttft": None if not r.ok else r.first_token - r.arrival,
                         "tokens": r.completion_tokens, "error": r.error} for r in records],
           "train_samples_per_s": job.samples_per_s(t0, t1, args.global_batch, skip) if job else None,
           "train_rate_left_out": None if skip is None else [skip[0] - t0, skip[1] - t0],  # from the run's start
           "train_micro_batches": job.micro_batches(t0, t1) if job else None,
           "train_step_ends": [t - t0 for t in job.steps if t0 <= t <= t1] if job else None,  # from the run's start
           "train_step_peaks_mib": job.peaks_mib(t0, t1) if job else None,
           # the server's swap-ins during the run (and their bytes and seconds) and the decode graphs it
           # captured (again after weights moved), from its /metrics
           "server_swaps": {k: v - swaps0.get(k, 0.0) for k, v in server_counters(server.url).items()} if server else None,
           "handovers": [], "limits": [], "timeline": [], "used": [], "job_profile": profile,
           "gpu": gpu_state}  # the GPU's clock, temperature and power through the run (None on the CPU)
    if server is not None and phase != "inference-alone":
        rep = server.report(t0)
        rel = lambda rows: [[r[0] - t0, *r[2:]] for r in rows if r[1] == 0]  # device 0, from the run's start
        out.update(handovers=[{**h, "t": h["t"] - t0} for h in rep["handovers"]], limits=rel(rep["limits"]),
                   yields=rel(rep.get("yields", [])), train_mosts=rel(rep.get("mosts", [])),
                   timeline=[[0.0, *before["shares"][0]], *rel(rep["timeline"])],
                   used=[[0.0, before["booked"][0]], *rel(rep["used"])],
                   train_share_at_start=before["shares"][0][1], capacity=rep["capacity"])
    return out


# phases under an arbiter: each mode, and static / colocate with the training job yielding the GPU's
# compute (``--colocate-yield``): ``+yield`` while inference has work, ``+yield-first`` while a request
# waits for its first token, ``+yield-cold`` while one that found its model off the GPU does; and
# ``static@GIB`` (with any yield) for a static split that gives training GIB GiB instead of
# ``--static-train-gb``, so that one call measures static at several splits
ARBITER_PHASES = (*MODES, "static+yield", "static+yield-first", "static+yield-cold", "colocate+yield",
                  "colocate+yield-first", "colocate+yield-cold")
YIELD_OF = {"": "none", "yield": "work", "yield-first": "first-token", "yield-cold": "cold"}


def parse_phase(phase: str) -> tuple[str, float | None, str]:
    """(mode, training's GiB or None, yield suffix) of an arbiter phase ``MODE[@GIB][+YIELD]``;
    ValueError for any other name."""
    base, plus, extra = phase.partition("+")
    mode, at, gib = base.partition("@")
    bad_yield = plus and (not extra or extra not in YIELD_OF or mode not in ("static", "colocate"))
    if mode not in MODES or bad_yield or (at and mode != "static"):
        raise ValueError(f"not an arbiter phase: {phase!r}")
    if not at:
        return mode, None, extra
    try:
        gb = float(gib)
    except ValueError:
        raise ValueError(f"{phase!r}: static@GIB takes training's share in GiB, got {gib!r}") from None
    if not 0 < gb < float("inf"):
        raise ValueError(f"{phase!r}: training's share must be a positive number of GiB")
    return mode, gb, extra


def is_arbiter_phase(phase: str) -> bool:
    try:
        parse_phase(phase)
    except ValueError:
        return False
    return True


def in_order(phases) -> list[str]:
    """The phases in the order they run and are reported: the references, the named arbiter phases,
    then the static splits by their share."""
    named = [p for p in (*REFERENCES, *ARBITER_PHASES) if p in phases]
    splits = sorted((p for p in set(phases) if p not in named and is_arbiter_phase(p)),
                    key=lambda p: (parse_phase(p)[1], p))
    return named + splits


def arbiter_settings(phase: str, static_train_gb: float | None = None) -> dict:
    """``POST /admin/colocation``'s body for an arbiter phase (``static_train_gb``: a static phase's
    share when the phase does not name one)."""
    mode, gb, extra = parse_phase(phase)
    out: dict = {"mode": mode, "yield_compute": YIELD_OF[extra]}
    if mode == "static" and (gb if gb is not None else static_train_gb) is not None:
        out["static_train"] = int((gb if gb is not None else static_train_gb) * GB)
    return out


# free: from the request's arrival; release = reach (the job's loop gets to it) + empty (the release itself)
HANDOVER_PARTS = ("wait", "signal", "release", "reach", "empty", "ack", "alloc", "swap", "free")


def solo_latencies(runs: list[dict]) -> dict[str, float]:
    """Each model's median latency over the requests of inference alone (all its repeats)."""
    by_model = collections.defaultdict(list)
    for r in runs:
        for q in r["requests"]:
            if q["latency"] is not None:
                by_model[q["model"]].append(q["latency"])
    return {m: float(np.median(v)) for m, v in sorted(by_model.items())}


def phase_row(r: dict, solo: dict[str, float] | None, train_alone: float | None) -> dict:
    """One run's figures: latency percentiles, SLO attainment at k x solo latency, training rate, handovers."""
    reqs = r["requests"]
    row = {"failures": sum(q["latency"] is None for q in reqs)}
    if reqs:
        lat = np.array([np.inf if q["latency"] is None else q["latency"] for q in reqs])
        row.update(p50_s=float(np.percentile(lat, 50)), p99_s=float(np.percentile(lat, 99)))
        ttft = [q["ttft"] for q in reqs if q["ttft"] is not None]
        if ttft:
            row.update(ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p99_s=float(np.percentile(ttft, 99)))
        if solo:
            base = np.array([solo.get(q["model"], np.nan) for q in reqs])
            known = np.isfinite(base)  # a model that never answered alone has no SLO
            if known.any():
                row["slo"] = {k: float(np.mean(lat[known] <= k * base[known])) for k in range(1, 9)}
    if r["train_samples_per_s"] is not None:
        row["train_samples_per_s"] = r["train_samples_per_s"]
        if train_alone:
            row["train_relative"] = r["train_samples_per_s"] / train_alone
    if is_arbiter_phase(r["mode"]):
        prev, shrinks = r.get("train_share_at_start"), 0
        for _, nbytes in r["limits"]:  # limits below the last one: training told to give memory back
            shrinks += prev is not None and nbytes < prev
            prev = nbytes
        row.update(train_limits=len(r["limits"]), train_shrinks=shrinks, handovers=len(r["handovers"]),
                   train_yields=sum(on for _, on in r.get("yields", [])))
    prof = r.get("job_profile")
    if prof and prof["inside_run"]:  # the job's own view of a window of its steps (--profile-job)
        row.update(job_step_ms=1e3 * prof["wall_s_per_step"], job_host_ms_per_step=1e3 * prof["host_self_s"] / prof["steps"],
                   job_profile_left_out_s=prof["wall_s"] + prof.get("post_s", 0.0))
        if prof["device_busy_share"] is not None:
            row.update(job_device_busy_share=prof["device_busy_share"],
                       job_kernel_ms_per_step=1e3 * prof["device_kernel_s"] / prof["steps"])
    if r.get("gpu"):  # a job slower in a later run on a GPU that clocked down is not slower for its mode
        row.update(gpu_sm_clock_mhz=r["gpu"]["sm_clock_mhz_median"], gpu_temperature_c_max=r["gpu"]["temperature_c_max"])
    for part in HANDOVER_PARTS:
        vals = [h[f"{part}_s"] for h in r["handovers"] if h.get(f"{part}_s") is not None]
        if vals:
            row[f"handover_{part}_p50_ms"] = 1e3 * float(np.percentile(vals, 50))
            row[f"handover_{part}_p99_ms"] = 1e3 * float(np.percentile(vals, 99))
    return row


def _median(rows: list[dict]):
    """The median of each figure over repeats (nested dicts figure by figure)."""
    out = {}
    for k in dict.fromkeys(k for r in rows for k in r):
        vals = [r[k] for r in rows if k in r]
        out[k] = _median(vals) if isinstance(vals[0], dict) else float(np.median(vals))
    return out


def pooled_slo(runs: list[dict], solo: dict[str, float] | None, k: int = 5) -> dict:
    """The SLO at ``k`` x solo latency over every request of all the repeats (a failed request misses),
    with its 95% Wilson interval: one run's requests resolve a point only when there are hundreds."""
    if not solo:
        return {}
    met = [q["latency"] is not None and q["latency"] <= k * solo[q["model"]]
           for r in runs for q in r["requests"] if q["model"] in solo]
    if not met:
        return {}
    n, p, z = len(met), sum(met) / len(met), 1.96
    mid, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return {"slo_pooled": {"k": k, "requests": n, "met": int(sum(met)), "share": p,
                           "wilson95": [0.0 if p == 0 else float(mid - half), 1.0 if p == 1 else float(mid + half)]}}


def summarize(runs: dict[str, list[dict]]) -> dict:
    """``runs``: phase -> its repeats. Solo latencies (per model) and the training-alone rate come from
    all their repeats; each phase's figures are the median over its repeats of each run's figures."""
    solo = solo_latencies(runs.get("inference-alone", [])) or None
    rates = [r["train_samples_per_s"] for r in runs.get("training-alone", [])]
    train_alone = float(np.median(rates)) if rates else None
    rows = []
    for phase in in_order(runs):
        if runs.get(phase):
            row = _median([phase_row(r, solo, train_alone) for r in runs[phase]])
            rows.append({"mode": phase, "repeats": len(runs[phase]), **row, **pooled_slo(runs[phase], solo)})
    return {"solo_latency_s": float(np.median(list(solo.values()))) if solo else None, "solo_latency_by_model_s": solo,
            "train_alone_samples_per_s": train_alone, "rows": rows}


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    """Memory by owner over each mode's first run: the arbiter's shares (stacked) and what inference booked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [runs[m][0] for m in in_order(runs) if is_arbiter_phase(m) and runs[m] and runs[m][0]["timeline"]]
    if not shown:
        return
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 2.2 * len(shown)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], shown):
        end = r["seconds"]
        t, inf, train = (np.array(c, dtype=float) for c in zip(*r["timeline"], [end, *r["timeline"][-1][1:]]))
        ax.fill_between(t, 0, inf / GB, step="post", alpha=0.6, label="inference share")
        ax.fill_between(t, inf / GB, (inf + train) / GB, step="post", alpha=0.6, label="training share")
        u = np.array([*r["used"], [end, r["used"][-1][1]]], dtype=float)
        ax.step(u[:, 0], u[:, 1] / GB, "k", where="post", lw=0.8, label="inference booked")
        for h in r["handovers"]:
            ax.axvline(h["t"], color="r", lw=0.4, alpha=0.5)
        on, label = None, "training yields compute"  # the spans it did, a band along the bottom
        for t, flag in [*r.get("yields", []), [end, False]]:
            if flag and on is None:
                on = t
            elif not flag and on is not None:
                ax.axvspan(on, t, ymax=0.06, color="k", alpha=0.7, lw=0, label=label)
                on, label = None, None
        if r.get("yields"):
            ax.legend(loc="upper right", fontsize=7)
        ax.set_ylabel("GiB")
        ax.set_title(f"{r['mode']} ({len(r['handovers'])} handovers, red)", fontsize=9)
    axes[0, 0].legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    arguments(p)
    return run(p.parse_args(argv), p)


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    own = {a.dest for a in p._actions if a.dest != "help"}  # not the command line's other settings (``func``)
    args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k in own})
    if args.job == "resnet" and not (EXAMPLES / "resnet_colocated.py").is_file():
        p.error(f"--job resnet runs {EXAMPLES / 'resnet_colocated.py'}, which is not there (a checkout has it)")
    for k, v in JOBS[args.job].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.profile_job < 0:
        p.error(f"--profile-job takes a number of steps, or 0 for none; got {args.profile_job}")
    if args.profile_job and args.job != "gpt":
        p.error("--profile-job profiles computron train (--job gpt)")
    phases = args.modes.split(",")
    unknown = [m for m in phases if m not in REFERENCES and not is_arbiter_phase(m)]
    if unknown or args.repeats < 1:
        p.error(f"unknown phase(s) {unknown}; known: {', '.join((*REFERENCES, *ARBITER_PHASES))}, and "
                f"static@GIB with any yield" if unknown else "--repeats must be at least 1")
    over = [m for m in phases if m not in REFERENCES and (parse_phase(m)[1] or 0) >= args.capacity_gb]
    if over:
        p.error(f"{over}: a static split gives training less than --capacity-gb ({args.capacity_gb:g} GiB)")
    try:
        lengths = [tuple(int(x) for x in v.split(":")) if ":" in v else int(v) for v in (args.prompt, args.output)]
    except ValueError:
        p.error("--prompt and --output take N or LO:HI")
    try:
        env_pairs(args.colocated_job_env)
    except ValueError as e:
        p.error(str(e))
    settings = {k: v for k, v in vars(args).items() if k not in ("modes", "repeats", "fresh", "tag", "out")}
    args.profile_root = tempfile.mkdtemp(prefix="computron-hybrid-profiles-")  # the jobs' --profile folders
    results = Path(args.out)
    results.mkdir(parents=True, exist_ok=True)
    store = results / f"hybrid_{args.tag}_runs.json"
    runs: dict[str, list[dict]] = {}
    if store.is_file() and not args.fresh:
        saved = json.loads(store.read_text())
        if saved["settings"] != settings:
            p.error(f"{store} holds runs with other settings ({saved['settings']}); use --fresh or another --tag")
        runs = saved["runs"]
    startup: dict[str, float] = {}

    def timed(name, fn):
        t = time.monotonic()
        out = fn()
        startup[name] = time.monotonic() - t
        print(f"start-up: {name} {startup[name]:.1f} s", flush=True)
        return out

    trace = make_workload(model_names(args), args.rate, args.duration, cv=args.cv, prompt=lengths[0],
                          output=lengths[1], seed=args.seed, start=args.start)
    print(f"trace: {len(trace)} requests over {args.duration:g} s, {args.models} models", flush=True)
    for phase in phases:
        runs[phase] = []

    def record(r):
        if runs[r["mode"]]:
            r["timeline"] = r["used"] = []  # one timeline per phase is plotted; the file stays small
        runs[r["mode"]].append(r)
        store.write_text(json.dumps({"settings": settings, "runs": runs}))  # after each run: nothing is lost
        print(r["mode"], json.dumps(phase_row(r, None, None)), flush=True)

    ckpt = None
    if args.job == "gpt" and set(phases) - {"inference-alone"}:
        ckpt = args.train_model or timed("checkpoint_s", lambda: gpt2_medium_checkpoint(
            Path(tempfile.gettempdir()) / "computron-gpt2-medium"))
    failed = None  # a run that fails ends the call; the runs before it are still summarized
    try:
        if "training-alone" in phases:  # first, while no server holds the device
            prof = profile_dir(args, None) if args.profile_job else None
            job = Job(job_command(args, ckpt, None, prof), args.job_timeout, prof)
            startup["alone_job_warmup_s"] = job.wait_steps(args.warmup_steps, 0, "training-alone")
            for _ in range(args.repeats):
                record(run_phase(args, "training-alone", trace, None, job))
            job.stop()
        modes = [m for m in in_order(phases) if is_arbiter_phase(m)]
        if "inference-alone" in phases or modes:
            addr = os.path.join(tempfile.mkdtemp(prefix="computron-hybrid-"), "arbiter.sock")
            server = timed("serve_ready_s", lambda: Server(args, addr, args.job_timeout))
            # the trace once, unrecorded: first-use costs (kernels, decode graphs of each batch size, the
            # swap path) stay out of inference alone's latencies, which every SLO is measured against
            warm = timed("serve_warmup_s", lambda: run_phase(args, "inference-alone", trace, server, None))
            if any(q["error"] for q in warm["requests"]):
                server.fail(f"the warm-up's requests failed: {[q['error'] for q in warm['requests'] if q['error']][:3]}")
            job, switches = None, []
            try:
                for _ in range(args.repeats if "inference-alone" in phases else 0):  # normal, and no job joins
                    record(run_phase(args, "inference-alone", trace, server, None))
                for _ in range(args.repeats if modes else 0):
                    for mode in modes:  # repeats go round the modes: drift spreads over all of them
                        switches.append(server.switch(mode))
                        if job is None:
                            prof = profile_dir(args, addr) if args.profile_job else None
                            job = Job(job_command(args, ckpt, addr, prof), args.job_timeout, prof,
                                      env_pairs(args.colocated_job_env))
                            startup["colocated_job_warmup_s"] = job.wait_steps(args.warmup_steps, 0, mode)
                        record(run_phase(args, mode, trace, server, job))
            finally:
                if job is not None:
                    job.stop()
                server.stop()
            if switches:
                startup["mode_switch_p50_s"] = float(np.median(switches))
    except Exception as e:  # a stopped process (RuntimeError, with its last lines) or anything unforeseen
        failed = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
        if not isinstance(e, RuntimeError):
            traceback.print_exc()
        print(f"stopped: {failed}", file=sys.stderr, flush=True)
    for name in ("alone_job_warmup_s", "colocated_job_warmup_s"):
        if name in startup:
            print(f"start-up: {name} {startup[name]:.1f} s (process start to {args.warmup_steps} steps)")
    summary = summarize(runs)
    out = results / f"hybrid_{args.tag}.json"
    device = "cpu"
    if args.device.startswith("cuda"):
        import torch

        device = torch.cuda.get_device_name()
    out.write_text(json.dumps({"args": vars(args), "startup": startup, "requests": len(trace), **summary,
                               "failed": failed, "device": device, "date": time.strftime("%Y-%m-%d %H:%M:%S")},
                              indent=1))
    plot(runs, out.with_suffix(".png"))
    for row in summary["rows"]:
        print(json.dumps(row))
    print(f"wrote {out}" + (" (the runs before the failure)" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
