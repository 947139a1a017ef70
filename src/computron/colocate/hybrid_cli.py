"""The ``computron bench hybrid`` command's arguments (``colocate/hybrid.py`` runs it), without its imports:
the command line stays quick to start."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arbiter import MODES
from ..workload.arrivals import STARTS

JOBS = {"gpt": dict(global_batch=32, micro_batch=16), "resnet": dict(global_batch=128, micro_batch=64)}
RESULTS = Path("bench") / "results"
REFERENCES = ("inference-alone", "training-alone")
DESCRIPTION = "Hybrid benchmark: a bursty inference workload against a training job on the same GPU, per mode."


def add_bench_parser(bench_subparsers) -> None:
    """``computron bench hybrid``."""
    p = bench_subparsers.add_parser("hybrid", help="a bursty inference workload against a training job on one GPU, "
                                                   "per colocation mode", description=DESCRIPTION)
    arguments(p)

    def run(args) -> int:
        from .hybrid import run

        return run(args, p)

    p.set_defaults(func=run)


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=int, default=4, help="copies of the preset served (default 4)")
    p.add_argument("--preset", default="opt-1.3b", help="the served models' preset (default opt-1.3b)")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second over all models")
    p.add_argument("--cv", type=float, default=4.0, help="coefficient of variation of inter-arrivals (bursty > 1)")
    p.add_argument("--start", choices=STARTS, default="stationary",
                   help="each model's arrivals seen from a random instant (default), or from an arrival at 0 (every "
                        "bursty stream then opens with a burst; how traces were made before 2026-11-29)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals in each run")
    p.add_argument("--prompt", default="128", help="prompt tokens per request: N or LO:HI (default 128)")
    p.add_argument("--output", "--tokens", default="32", help="output tokens per request: N or LO:HI (default 32)")
    p.add_argument("--capacity-gb", type=float, default=24.0,
                   help="GB shared by inference (weights and KV cache) and training: the arbiter's capacity")
    p.add_argument("--workspace-gb", type=float, default=2.0,
                   help="GB the server keeps beside that for activations (its budget is capacity + workspace)")
    p.add_argument("--static-train-gb", type=float, default=14.0, help="static mode: training's share")
    p.add_argument("--idle", type=float, default=2.0, help="seconds of inference idle before memory goes back")
    p.add_argument("--at-boundary", action="store_true", help="release at micro-batch boundaries, not at once")
    p.add_argument("--serve-args", default="", help="more arguments for the server's command line")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds one request may take")
    p.add_argument("--job", choices=sorted(JOBS), default="gpt",
                   help="gpt: computron train; resnet: examples/resnet_colocated.py")
    p.add_argument("--train-model", default=None, help="gpt: the job's model (default: a GPT-2-medium shape)")
    p.add_argument("--train-args", default="", help="more arguments for the job's command line")
    p.add_argument("--seq-len", type=int, default=512, help="gpt: tokens per sample")
    p.add_argument("--global-batch", type=int, default=None, help="default: gpt 32, resnet 128")
    p.add_argument("--micro-batch", type=int, default=None, help="default: gpt 16, resnet 64")
    p.add_argument("--run-ahead", type=int, default=8, help="the colocated job's run-ahead bound (0: unbounded)")
    p.add_argument("--colocated-job-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for the colocated job's process only, not the job alone's "
                        "(e.g. CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 under MPS: bench/gpu_hybrid_mps.sh); repeatable")
    p.add_argument("--warmup-steps", type=int, default=3, help="job steps before its first measured run")
    p.add_argument("--profile-job", type=int, default=0, metavar="STEPS",
                   help="gpt: profile this many of the job's steps in each run, a third of the way in (its "
                        "kernels' time, the GPU's busy share from the job's side; 0: off)")
    p.add_argument("--modes", default=",".join((*REFERENCES, *MODES, "colocate+yield", "colocate+yield-first")),
                   help="phases to run now, of inference-alone, training-alone, the modes, static+yield and "
                        "colocate+yield (training yields the compute while inference has work), static+yield-first "
                        "and colocate+yield-first (while a request waits for its first token), static+yield-cold and "
                        "colocate+yield-cold (while one that found its model off the GPU does), and static@GIB "
                        "(static with training given GIB GiB, with any yield: static at several splits in one "
                        "call); runs are kept in "
                        "bench/results/hybrid_<tag>_runs.json, so a comparison can be split over several "
                        "invocations (same settings, same trace) and the summary covers every phase stored")
    p.add_argument("--job-timeout", type=float, default=300.0,
                   help="seconds a job or the server may take to start, warm up, or settle into a new run")
    p.add_argument("--repeats", type=int, default=3, help="runs per phase; figures are medians over them")
    p.add_argument("--fresh", action="store_true", help="drop the runs stored under this tag first")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="h100")
    p.add_argument("--out", default=str(RESULTS), help="directory for the results (default bench/results)")
