"""Hybrid benchmark: a bursty inference workload against a training job on the same GPU, per mode.

Runs, on one trace (Gamma arrivals: --rate, --cv, --duration, uniformly over --models copies of
an OPT-1.3B-shaped model): inference alone, training alone, and the trainer colocated in each of
the arbiter's modes (normal, static, task-switch, colocate), each --repeats times. The inference
side is this process: an ArbiterServer per run plus a stand-in server that keeps each model's
weights in pinned host memory, asks the arbiter for memory before a swap-in (``demand``), swaps
the weights in (allocation + host-to-GPU copy), and decodes ``--tokens`` tokens by reading all the
weights once per token. Over budget it evicts least-recently-used models; when the arbiter
shrinks its share it evicts down to it. The training job runs in its own process, talking to the
arbiter over a Unix socket: ``--job gpt`` is ``computron train`` (a GPT-2-medium shape by
default, bf16 autocast), ``--job resnet`` is ``examples/resnet_colocated.py`` (ResNet-50, SGD).

Start-up is paid once: the host images are built once (random values generated on the GPU), one
job process runs every training-alone run and another, started with the first mode's arbiter and
reconnecting to each next one, every colocated run; repeats go round the modes in turn. Each
start-up part is timed and reported.

Reports per phase (medians over repeats): SLO attainment at k x solo latency (k = 1..8; solo: the
median latency of inference alone), p50/p99 latency, training samples/s relative to training
alone, the handover split into signal, training release, ack, inference allocation and swap-in,
and a PNG timeline of memory by owner. Writes bench/results/hybrid_<tag>.json (and .png).

    PYTHONPATH=src python bench/hybrid.py --duration 20 --repeats 3 --tag h100          # all phases
    PYTHONPATH=src python bench/hybrid.py --job resnet --duration 20 --repeats 3 --tag h100_resnet
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from computron.colocate.arbiter import MODES, Arbiter, ArbiterConfig
from computron.colocate.protocol import ArbiterServer
from computron.memory.host import host_buffer

GB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
JOBS = {"gpt": dict(global_batch=32, micro_batch=16), "resnet": dict(global_batch=128, micro_batch=64)}


def gpt2_medium_checkpoint(path: Path) -> str:
    """A GPT-2-medium-shaped checkpoint with random weights (the presets stop at gpt2-small)."""
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


class Inference:
    """The stand-in inference server: models in pinned host memory, swapped in on demand."""

    def __init__(self, args, device: torch.device):
        self.args, self.device = args, device
        n = int(args.model_gb * GB) // 2
        self.hosts = [host_buffer(n * 2, pin=device.type == "cuda").view(torch.bfloat16) for _ in range(args.models)]
        gen = torch.Generator(device=device).manual_seed(args.seed)
        for h in self.hosts:  # random weights; the GPU's generator is much faster than the CPU's (single-threaded)
            for i in range(0, n, 1 << 28):
                part = h[i:i + (1 << 28)]
                part.copy_(torch.randn(part.shape, dtype=part.dtype, device=device, generator=gen))
        self.lock = threading.Lock()
        self.start(None, 0)

    def start(self, server: ArbiterServer | None, most: int) -> None:
        """A new run: nothing resident, inference holding at most ``most`` bytes, under ``server``."""
        self.server, self.most = server, most
        self.resident: dict[int, torch.Tensor] = {}  # model -> GPU weights, in LRU order
        self.parts: list[dict] = []
        self.failures = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resident_bytes(self) -> int:
        return sum(t.numel() * 2 for t in self.resident.values())

    def fit(self, device: int, budget: int) -> None:  # the arbiter's on_share: evict down to the budget
        with self.lock:
            while self.resident and self.resident_bytes() > budget:
                self.resident.pop(next(iter(self.resident)))
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def serve(self, model: int) -> None:
        a = self.args
        with self.lock:
            w = self.resident.pop(model, None)
        part = {}
        if w is None:
            need = self.hosts[model].numel() * 2
            with self.lock:  # evict LRU models the share cannot hold alongside this one
                while self.resident and self.resident_bytes() + need > self.most:
                    self.resident.pop(next(iter(self.resident)))
            if self.server is not None:
                rec = self.server.demand(0, self.resident_bytes() + need, timeout=30)
                part.update(wait_s=rec["wait_s"], signal_s=rec["signal_s"], release_s=rec["release_s"],
                            ack_s=rec["ack_s"])
            t0 = time.perf_counter()
            w = torch.empty_like(self.hosts[model], device=self.device)
            sync(self.device)
            t1 = time.perf_counter()
            w.copy_(self.hosts[model], non_blocking=True)
            sync(self.device)
            part.update(alloc_s=t1 - t0, swap_s=time.perf_counter() - t1)
            self.parts.append(part)
        with self.lock:
            self.resident[model] = w
        if self.server is not None:
            self.server.busy(0)
        mat = w[: (w.numel() // 2048) * 2048].view(-1, 2048)
        x = torch.ones(2048, 1, dtype=torch.bfloat16, device=self.device)
        for _ in range(a.tokens):  # decode: every token reads all the weights
            mat @ x
        sync(self.device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trace(args) -> list[tuple[float, int]]:
    rng = np.random.default_rng(args.seed)
    shape = 1.0 / args.cv ** 2
    t, out = 0.0, []
    while True:
        t += rng.gamma(shape, 1.0 / (args.rate * shape))
        if t >= args.duration:
            return out
        out.append((t, int(rng.integers(args.models))))


def job_command(args, ckpt: str | None, addr: str | None) -> list[str]:
    """The training job's command line (``--job``), colocated under ``addr`` when given."""
    if args.job == "resnet":
        cmd = [sys.executable, str(ROOT / "examples" / "resnet_colocated.py"), "--steps", "1000000",
               "--device", args.device]
        cmd += ["--colocate", addr, "--run-ahead", str(args.run_ahead)] if addr else []
    else:
        cmd = [sys.executable, "-m", "computron.cli", "train", "--model", ckpt, "--steps", "1000000",
               "--seq-len", str(args.seq_len), "--device", args.device]
        cmd += ["--colocate", addr, "--colocate-run-ahead", str(args.run_ahead)] if addr else []
    return cmd + ["--global-batch", str(args.global_batch), "--micro-batch", str(args.micro_batch),
                  *shlex.split(args.train_args)]


class Job:
    """The training job's process; its step lines are timed as they come."""

    def __init__(self, cmd: list[str], timeout_s: float = 300.0):
        self.timeout_s = timeout_s  # for its start-up and warm-up steps, or its settling into a new run
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                         os.environ.get("PYTHONPATH")]))}
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
        self.steps: list[float] = []  # when each step line came
        self.last_lines = collections.deque(maxlen=120)  # what it said last, shown if it never gets going
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.last_lines.append(line.rstrip())
            if re.match(r"step (\d+)/", line):
                self.steps.append(time.monotonic())
            elif "rror" in line or "Traceback" in line:
                print("trainer:", line.rstrip(), file=sys.stderr)

    def wait_steps(self, n: int, after: float, what: str) -> float:
        """Wait for ``n`` steps ending after ``after``; the seconds since the job started."""
        deadline = time.monotonic() + self.timeout_s
        while sum(t > after for t in self.steps) < n:
            if self.p.poll() is not None or time.monotonic() > deadline:
                if self.p.poll() is None:  # stuck: its threads' stacks (the train CLI prints them on SIGUSR1)
                    self.p.send_signal(signal.SIGUSR1)
                    time.sleep(2.0)
                self.stop()
                raise RuntimeError(f"{what}: the training job made {sum(t > after for t in self.steps)} of {n} steps "
                                   f"in {self.timeout_s:.0f} s; it said last:\n" + "\n".join(self.last_lines))
            time.sleep(0.02)
        return time.monotonic() - self.t0

    def samples_per_s(self, t0: float, t1: float, batch: int) -> float:
        return sum(t0 <= t <= t1 for t in self.steps) * batch / (t1 - t0)

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()


def arbiter(args, mode: str, addr: str, inf: Inference | None) -> ArbiterServer:
    cfg = ArbiterConfig(mode=mode, capacity=int(args.capacity_gb * GB), static_train=int(args.static_train_gb * GB),
                        idle_s=args.idle, immediate=not args.at_boundary)
    server = ArbiterServer(Arbiter(cfg), addr)
    server.on_share = inf.fit if inf is not None else None
    return server


def run_phase(args, phase: str, inf: Inference | None, job: Job | None, server: ArbiterServer | None,
              arrivals) -> dict:
    """One run of ``phase`` over the trace: inference (if ``inf``) against the job (if any) under ``server``."""
    device = torch.device(args.device)
    capacity = int(args.capacity_gb * GB)
    if inf is not None:
        inf.start(server, capacity - int(args.static_train_gb * GB) if phase == "static" else capacity)
    timeline, done = [], threading.Event()

    def sample():
        while not done.is_set():
            shares = server.arbiter.shares(0) if server else (0, 0)
            timeline.append((time.monotonic(), shares[0], shares[1], inf.resident_bytes() if inf else 0))
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.monotonic()
    lat = []
    for at, model in (arrivals if inf is not None else []):
        while time.monotonic() - t0 < at:
            time.sleep(min(0.001, max(0.0, at - (time.monotonic() - t0))))
        try:
            inf.serve(model)
            lat.append(time.monotonic() - t0 - at)
        except (torch.OutOfMemoryError, TimeoutError):
            inf.failures += 1
            lat.append(float("inf"))
    while time.monotonic() - t0 < args.duration:
        time.sleep(0.05)
    t1 = time.monotonic()
    done.set()
    out = {"mode": phase, "latencies": lat,
           "train_samples_per_s": job.samples_per_s(t0, t1, args.global_batch) if job else None,
           "handovers": inf.parts if inf else [], "failures": inf.failures if inf else 0,
           "timeline": [(t - t0, a, b, c) for t, a, b, c in timeline]}
    if inf is not None:
        inf.start(None, 0)  # the next run starts with nothing resident
    elif device.type == "cuda":
        torch.cuda.empty_cache()
    return out


REFERENCES = ("inference-alone", "training-alone")


def phase_row(r: dict, solo: float | None, train_alone: float | None) -> dict:
    """One run's figures: latency percentiles, SLO attainment at k x solo latency, training rate, handovers."""
    row = {"failures": r["failures"]}
    if r["latencies"]:
        lat = np.array(r["latencies"])
        row.update(p50_s=float(np.percentile(lat, 50)), p99_s=float(np.percentile(lat, 99)))
        if solo:
            row["slo"] = {k: float(np.mean(lat <= k * solo)) for k in range(1, 9)}
    if r["train_samples_per_s"] is not None:
        row["train_samples_per_s"] = r["train_samples_per_s"]
        if train_alone:
            row["train_relative"] = r["train_samples_per_s"] / train_alone
    waits = [h for h in r["handovers"] if h.get("signal_s") is not None]
    if waits:
        for key in ("wait_s", "signal_s", "release_s", "ack_s", "alloc_s", "swap_s"):
            vals = [h[key] for h in waits]
            row[f"handover_{key[:-2]}_p50_ms"] = 1e3 * float(np.percentile(vals, 50))
            row[f"handover_{key[:-2]}_p99_ms"] = 1e3 * float(np.percentile(vals, 99))
        row["handovers"] = len(waits)
    return row


def _median(rows: list[dict]):
    """The median of each figure over repeats (nested dicts figure by figure)."""
    out = {}
    for k in rows[0]:
        vals = [r[k] for r in rows if k in r]
        out[k] = _median(vals) if isinstance(vals[0], dict) else float(np.median(vals))
    return out


def summarize(runs: dict[str, list[dict]]) -> dict:
    """``runs``: phase -> its repeats. Solo latency and training-alone rate are medians over their
    repeats; each phase's figures are the median over its repeats of each run's figures."""
    solos = [float(np.median([x for x in r["latencies"] if np.isfinite(x)])) for r in runs.get("inference-alone", [])]
    rates = [r["train_samples_per_s"] for r in runs.get("training-alone", [])]
    solo = float(np.median(solos)) if solos else None
    train_alone = float(np.median(rates)) if rates else None
    rows = []
    for phase in [*REFERENCES, *MODES]:
        if runs.get(phase):
            row = _median([phase_row(r, solo, train_alone) for r in runs[phase]])
            rows.append({"mode": phase, "repeats": len(runs[phase]), **row})
    return {"solo_latency_s": solo, "train_alone_samples_per_s": train_alone, "rows": rows}


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [rs[0] for m, rs in runs.items() if m in MODES and rs and rs[0]["timeline"]]  # each mode's first run
    if not shown:
        return
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 2.2 * len(shown)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], shown):
        t, inf, train, res = (np.array(c) for c in zip(*r["timeline"]))
        ax.stackplot(t, inf / GB, train / GB, labels=["inference share", "training share"], alpha=0.6)
        ax.plot(t, res / GB, "k", lw=0.8, label="inference resident")
        ax.set_ylabel("GiB")
        ax.set_title(r["mode"], fontsize=9)
    axes[0, 0].legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=int, default=4, help="OPT-1.3B-sized models (default 4)")
    p.add_argument("--model-gb", type=float, default=2.63, help="GB of weights per model (OPT-1.3B bf16: 2.63)")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--cv", type=float, default=4.0, help="coefficient of variation of inter-arrivals (bursty > 1)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of each run")
    p.add_argument("--tokens", type=int, default=32, help="decode tokens per request")
    p.add_argument("--capacity-gb", type=float, default=24.0, help="GB shared by inference and training")
    p.add_argument("--static-train-gb", type=float, default=14.0, help="static mode: training's share")
    p.add_argument("--idle", type=float, default=2.0, help="seconds of inference idle before memory goes back")
    p.add_argument("--at-boundary", action="store_true", help="release at micro-batch boundaries, not at once")
    p.add_argument("--job", choices=sorted(JOBS), default="gpt",
                   help="gpt: computron train; resnet: examples/resnet_colocated.py")
    p.add_argument("--train-model", default=None, help="gpt: the job's model (default: a GPT-2-medium shape)")
    p.add_argument("--train-args", default="", help="more arguments for the job's command line")
    p.add_argument("--seq-len", type=int, default=512, help="gpt: tokens per sample")
    p.add_argument("--global-batch", type=int, default=None, help="default: gpt 32, resnet 128")
    p.add_argument("--micro-batch", type=int, default=None, help="default: gpt 16, resnet 64")
    p.add_argument("--run-ahead", type=int, default=8, help="the colocated job's run-ahead bound (0: unbounded)")
    p.add_argument("--warmup-steps", type=int, default=3, help="job steps before its first measured run")
    p.add_argument("--modes", default=",".join((*REFERENCES, *MODES)),
                   help="phases to run now, of inference-alone, training-alone and the modes; runs are kept in "
                        "bench/results/hybrid_<tag>_runs.json, so a comparison can be split over several "
                        "invocations (same settings, same trace) and the summary covers every phase stored")
    p.add_argument("--job-timeout", type=float, default=300.0,
                   help="seconds a job may take to start, warm up, or make its first step under a new arbiter")
    p.add_argument("--repeats", type=int, default=3, help="runs per phase; figures are medians over them")
    p.add_argument("--fresh", action="store_true", help="drop the runs stored under this tag first")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="h100")
    p.add_argument("--out", default=str(RESULTS), help="directory for the results")
    args = p.parse_args(argv)
    for k, v in JOBS[args.job].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    phases = args.modes.split(",")
    unknown = [m for m in phases if m not in (*REFERENCES, *MODES)]
    if unknown or args.repeats < 1:
        p.error(f"unknown phase(s) {unknown}; known: {', '.join((*REFERENCES, *MODES))}" if unknown
                else "--repeats must be at least 1")
    settings = {k: v for k, v in vars(args).items() if k not in ("modes", "repeats", "fresh", "tag", "out")}
    results = Path(args.out)
    results.mkdir(parents=True, exist_ok=True)
    store = results / f"hybrid_{args.tag}_runs.json"
    runs: dict[str, list[dict]] = {}
    if store.is_file() and not args.fresh:
        saved = json.loads(store.read_text())
        if saved["settings"] != settings:
            p.error(f"{store} holds runs with other settings ({saved['settings']}); use --fresh or another --tag")
        runs = saved["runs"]
    device, startup = torch.device(args.device), {}

    def timed(name, fn):
        t = time.monotonic()
        out = fn()
        startup[name] = time.monotonic() - t
        print(f"start-up: {name} {startup[name]:.1f} s", flush=True)
        return out

    ckpt = None
    if args.job == "gpt":
        ckpt = args.train_model or timed("checkpoint_s", lambda: gpt2_medium_checkpoint(
            Path(tempfile.gettempdir()) / "computron-gpt2-medium"))
    arrivals = trace(args)
    inf = timed("host_images_s", lambda: Inference(args, device)) if set(phases) - {"training-alone"} else None
    for phase in phases:
        runs[phase] = []

    def record(r):
        if runs[r["mode"]]:
            r["timeline"] = []  # one timeline per phase is plotted; the file stays small
        runs[r["mode"]].append(r)
        store.write_text(json.dumps({"settings": settings, "runs": runs}))  # after each run: nothing is lost
        print(json.dumps(phase_row(r, None, None)), flush=True)

    for _ in range(args.repeats if "inference-alone" in phases else 0):
        record(run_phase(args, "inference-alone", inf, None, None, arrivals))
    if "training-alone" in phases:
        job = Job(job_command(args, ckpt, None), args.job_timeout)
        startup["alone_job_warmup_s"] = job.wait_steps(args.warmup_steps, 0, "training-alone")
        for _ in range(args.repeats):
            record(run_phase(args, "training-alone", None, job, None, arrivals))
        job.stop()
    modes, job = [m for m in MODES if m in phases], None
    addr = tempfile.mktemp(suffix=".sock")
    for _ in range(args.repeats if modes else 0):
        for mode in modes:  # repeats go round the modes: drift spreads over all of them
            server = arbiter(args, mode, addr, inf)
            if job is None:
                job = Job(job_command(args, ckpt, addr), args.job_timeout)
                startup["colocated_job_warmup_s"] = job.wait_steps(args.warmup_steps, 0, mode)
            else:  # the job finds the new arbiter; one step under it before the run
                deadline = time.monotonic() + job.timeout_s
                while not server.trainer_connected(0) and time.monotonic() < deadline:
                    time.sleep(0.01)
                job.wait_steps(1, time.monotonic(), mode)
            try:
                record(run_phase(args, mode, inf, job, server, arrivals))
            finally:
                server.on_share = None
                server.close()
    if job is not None:
        job.stop()
    for name in ("alone_job_warmup_s", "colocated_job_warmup_s"):
        if name in startup:
            print(f"start-up: {name} {startup[name]:.1f} s (process start to {args.warmup_steps} steps)")
    summary = summarize(runs)
    out = results / f"hybrid_{args.tag}.json"
    out.write_text(json.dumps({"args": vars(args), "startup": startup, "requests": len(arrivals), **summary,
                               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    plot(runs, out.with_suffix(".png"))
    for row in summary["rows"]:
        print(json.dumps(row))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
