"""Hybrid benchmark: a bursty inference workload against a training job on the same GPU, per mode.

Runs, on one trace (Gamma arrivals: --rate, --cv, --duration, uniformly over --models copies of
an OPT-1.3B-shaped model): inference alone, training alone, and the trainer colocated in each of
the arbiter's modes (normal, static, task-switch, colocate). The inference side is this process:
an ArbiterServer plus a stand-in server that keeps each model's weights in pinned host memory,
asks the arbiter for memory before a swap-in (``demand``), swaps the weights in (allocation +
host-to-GPU copy), and decodes ``--tokens`` tokens by reading all the weights once per token.
Over budget it evicts least-recently-used models; when the arbiter shrinks its share it evicts
down to it. The training job is ``computron train`` in its own process (a GPT-2-medium shape by
default, bf16 autocast), talking to the arbiter over a Unix socket.

Reports per run: SLO attainment at k x solo latency (k = 1..8; solo: the median latency of
inference alone), p50/p99 latency, training samples/s relative to training alone, the handover
split into signal, training release, ack, inference allocation and swap-in, and a PNG timeline
of memory by owner. Writes bench/results/hybrid_<tag>.json (and .png).

    .venv/bin/python bench/hybrid.py --duration 60 --rate 4 --cv 4 --models 4
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
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
RESULTS = Path(__file__).parent / "results"


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

    def __init__(self, args, server: ArbiterServer | None, device: torch.device):
        self.args, self.server, self.device = args, server, device
        n = int(args.model_gb * GB) // 2
        self.hosts = [host_buffer(n * 2, pin=device.type == "cuda").view(torch.bfloat16) for _ in range(args.models)]
        for h in self.hosts:
            h.normal_()
        self.resident: dict[int, torch.Tensor] = {}  # model -> GPU weights, in LRU order
        self.lock = threading.Lock()
        self.copy = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.parts: list[dict] = []
        self.failures = 0

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
                while self.resident and self.resident_bytes() + need > a.inference_max:
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


def start_trainer(args, addr: str | None, ckpt: str, out: list):
    cmd = [sys.executable, "-m", "computron.cli", "train", "--model", ckpt, "--steps", "1000000",
           "--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch),
           "--micro-batch", str(args.micro_batch), "--device", args.device]
    if addr:
        cmd += ["--colocate", addr]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    p.last_lines = collections.deque(maxlen=30)  # what it said last, shown if it never gets going

    def read():
        for line in p.stdout:
            p.last_lines.append(line.rstrip())
            if m := re.match(r"step (\d+)/", line):
                out.append((time.monotonic(), int(m.group(1))))
            elif "rror" in line or "Traceback" in line:
                print("trainer:", line.rstrip(), file=sys.stderr)

    threading.Thread(target=read, daemon=True).start()
    return p


def run_one(args, mode: str | None, with_train: bool, with_infer: bool, ckpt: str, arrivals) -> dict:
    device = torch.device(args.device)
    capacity = int(args.capacity_gb * GB)
    addr = tempfile.mktemp(suffix=".sock")
    server, steps, timeline = None, [], []
    if mode is not None:
        cfg = ArbiterConfig(mode=mode, capacity=capacity, static_train=int(args.static_train_gb * GB),
                            idle_s=args.idle, immediate=not args.at_boundary)
        server = ArbiterServer(Arbiter(cfg), addr)
    inf = Inference(args, server, device) if with_infer else None
    if server is not None and inf is not None:
        server.on_share = inf.fit
    args.inference_max = capacity if mode in (None, "normal", "task-switch", "colocate") else \
        capacity - int(args.static_train_gb * GB)
    trainer = start_trainer(args, addr if server else None, ckpt, steps) if with_train else None
    if trainer is not None:  # warm up: the job's first steps (CUDA init, allocator) are not measured
        deadline = time.monotonic() + WARMUP_TIMEOUT_S
        while len(steps) < args.warmup_steps and trainer.poll() is None:
            if time.monotonic() > deadline:
                trainer.kill()
                if server is not None:
                    server.close()
                raise RuntimeError(f"{mode or 'training-alone'}: the training job made {len(steps)} of its "
                                   f"{args.warmup_steps} warm-up steps in {WARMUP_TIMEOUT_S:.0f} s; it said last:\n"
                                   + "\n".join(trainer.last_lines))
            time.sleep(0.05)
    done = threading.Event()

    def sample():
        while not done.is_set():
            shares = server.arbiter.shares(0) if server else (0, 0)
            timeline.append((time.monotonic(), shares[0], shares[1], inf.resident_bytes() if inf else 0))
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.monotonic()
    lat = []
    for at, model in (arrivals if with_infer else []):
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
    rate = None
    if trainer is not None:
        inside = [s for t, s in steps if t0 <= t <= t1]
        rate = (len(inside) * args.global_batch) / (t1 - t0) if inside else 0.0
        trainer.terminate()
        trainer.wait(30)
    if server is not None:
        server.close()
    out = {"mode": mode or ("inference-alone" if with_infer else "training-alone"), "latencies": lat,
           "train_samples_per_s": rate, "handovers": inf.parts if inf else [], "failures": inf.failures if inf else 0,
           "timeline": [(t - t0, a, b, c) for t, a, b, c in timeline]}
    del inf
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return out


REFERENCES = ("inference-alone", "training-alone")
WARMUP_TIMEOUT_S = 120.0


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=int, default=4, help="OPT-1.3B-sized models (default 4)")
    p.add_argument("--model-gb", type=float, default=2.63, help="GB of weights per model (OPT-1.3B bf16: 2.63)")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--cv", type=float, default=4.0, help="coefficient of variation of inter-arrivals (bursty > 1)")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--tokens", type=int, default=32, help="decode tokens per request")
    p.add_argument("--capacity-gb", type=float, default=24.0, help="GB shared by inference and training")
    p.add_argument("--static-train-gb", type=float, default=14.0, help="static mode: training's share")
    p.add_argument("--idle", type=float, default=2.0, help="seconds of inference idle before memory goes back")
    p.add_argument("--at-boundary", action="store_true", help="release at micro-batch boundaries, not at once")
    p.add_argument("--train-model", default=None, help="the job's model (default: a GPT-2-medium shape)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--modes", default=",".join((*REFERENCES, *MODES)),
                   help="phases to run now, of inference-alone, training-alone and the modes; runs are kept in "
                        "bench/results/hybrid_<tag>_runs.json, so a long comparison can be split over several "
                        "invocations (same settings, same trace) and the summary covers every phase stored")
    p.add_argument("--repeats", type=int, default=1, help="runs per phase; figures are medians over them")
    p.add_argument("--fresh", action="store_true", help="drop the runs stored under this tag first")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="h100")
    args = p.parse_args()
    phases = args.modes.split(",")
    unknown = [m for m in phases if m not in (*REFERENCES, *MODES)]
    if unknown or args.repeats < 1:
        p.error(f"unknown phase(s) {unknown}; known: {', '.join((*REFERENCES, *MODES))}" if unknown
                else "--repeats must be at least 1")
    settings = {k: v for k, v in vars(args).items() if k not in ("modes", "repeats", "fresh", "tag")}
    RESULTS.mkdir(exist_ok=True)
    store = RESULTS / f"hybrid_{args.tag}_runs.json"
    runs: dict[str, list[dict]] = {}
    if store.is_file() and not args.fresh:
        saved = json.loads(store.read_text())
        if saved["settings"] != settings:
            p.error(f"{store} holds runs with other settings ({saved['settings']}); use --fresh or another --tag")
        runs = saved["runs"]
    ckpt = args.train_model or gpt2_medium_checkpoint(Path(tempfile.gettempdir()) / "computron-gpt2-medium")
    arrivals = trace(args)
    for phase in phases:
        runs[phase] = []
        for _ in range(args.repeats):
            with_train, with_infer = phase != "inference-alone", phase != "training-alone"
            r = run_one(args, phase if phase in MODES else None, with_train, with_infer, ckpt, arrivals)
            if runs[phase]:
                r["timeline"] = []  # one timeline per phase is plotted; the file stays small
            runs[phase].append(r)
        store.write_text(json.dumps({"settings": settings, "runs": runs}))  # after each phase: nothing is lost
        print(json.dumps(summarize(runs)["rows"]), flush=True)
    out = RESULTS / f"hybrid_{args.tag}.json"
    summary = summarize(runs)
    out.write_text(json.dumps({"args": vars(args), "requests": len(arrivals), **summary,
                               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"},
                              indent=1))
    plot(runs, out.with_suffix(".png"))
    for row in summary["rows"]:
        print(json.dumps(row))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
