"""``computron train``: train a decoder of this project (a preset or a checkpoint) on a text file or
synthetic tokens, optionally colocated with an inference server (``--colocate ADDRESS``), or over
several processes (``--nproc N`` on this machine, or one process per GPU under ``torchrun``) with
data, tensor and pipeline parallelism."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
from dataclasses import fields


def add_parser(sub) -> None:
    from ..bench.common import positive_int
    from .config import TrainConfig

    p = sub.add_parser("train", help="train a model (AdamW, gradient accumulation), colocated with serving or not",
                       description=__doc__.splitlines()[0])
    d = TrainConfig()
    p.add_argument("--model", default=d.model, help="preset name or checkpoint directory")
    p.add_argument("--data", default=None, help="a text file, tokenized with the model's tokenizer (default: "
                                                "synthetic tokens)")
    for name, help_ in [("seq_len", "tokens per sample"), ("global_batch", "samples per optimizer step"),
                        ("micro_batch", "the largest micro-batch"), ("steps", "optimizer steps in all"),
                        ("seed", "weights and data order"), ("checkpoint_every", "steps between checkpoints "
                                                                                  "(0: at the end)")]:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name), help=help_)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto: cuda when there is one)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="auto: bfloat16 on the GPU (bf16 weight copies, float32 masters, gradients and AdamW), float32 on the CPU")
    p.add_argument("--checkpoint", default=None, help="directory for safetensors checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint when it holds one")
    p.add_argument("--colocate", default=None, metavar="ADDRESS", help="the arbiter's socket path or host:port")
    p.add_argument("--colocate-device", type=int, default=0)
    p.add_argument("--colocate-run-ahead", type=int, default=d.colocate_run_ahead,
                   help="module calls the host may queue ahead of the GPU, so that a handover is acted on within that much queued work (0: unbounded)")
    p.add_argument("--colocate-fence-every", type=int, default=d.colocate_fence_every,
                   help="record the run-ahead's CUDA event at every this many module calls (1 to --colocate-run-ahead; "
                   "default: 4, or the run-ahead when smaller)")
    p.add_argument("--json", default=None, help="write per-step records to this JSON file")
    g = p.add_argument_group("profiling (torch.profiler over a window of steps; train/profile.py)")
    g.add_argument("--profile", default=None, metavar="DIR",
                   help="write step profiles here: at --profile-at, and whenever DIR/request appears")
    g.add_argument("--profile-at", type=positive_int, default=None, metavar="STEP",
                   help="profile from this step (1-based)")
    g.add_argument("--profile-steps", type=positive_int, default=d.profile_steps, help="steps in a profile window")
    g.add_argument("--profile-trace", action="store_true", help="also write each window's timeline (chrome trace)")
    g = p.add_argument_group("parallelism (one process per rank: --nproc, or torchrun's environment)")
    g.add_argument("--nproc", type=int, default=1, help="processes to start on this machine")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    g.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: processes / (tp*pp))")
    g.add_argument("--zero1", action="store_true", help="shard the optimizer state over the data-parallel ranks")
    g.add_argument("--virtual-stages", type=int, default=d.virtual_stages,
                   help="model chunks per pipeline rank (> 1: interleaved 1F1B)")
    g.add_argument("--partition", default=None, help="layers per pipeline stage, e.g. 7,5 (default: uniform)")
    g.add_argument("--recompute", action="store_true", help="recompute each layer's activations in the backward")
    g.add_argument("--cuda-graphs", action="store_true",
                   help="replay each micro-batch's forward and backward (collectives included) as one CUDA graph, "
                        "captured once per micro-batch size (a pipeline's: per stage and micro-batch in flight): "
                        "the host launches one graph instead of every kernel (CUDA, no colocation)")
    g.add_argument("--timeout", type=float, default=d.timeout_s, dest="timeout_s",
                   help="seconds a collective may wait before the job fails")
    p.set_defaults(func=run, _fields=[f.name for f in fields(TrainConfig)])


def _dims(args, world: int) -> dict:
    dp = args.dp or world // (args.tp * args.pp)
    if dp * args.tp * args.pp != world:
        raise ValueError(f"dp={args.dp or '?'} x tp={args.tp} x pp={args.pp} does not make the job's {world} processes")
    return {"dp": dp, "tp": args.tp, "pp": args.pp}


def run(args) -> int:
    from .. import cuda_sync
    from .dist import RankFailed, env_world, spawn

    if args.nproc > 1 and env_world() == 1:
        try:
            _dims(args, args.nproc)
            cuda_sync.policy()  # a bad value said once, not by every rank
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        try:
            spawn(args.nproc, run_rank, args)
        except RankFailed as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    return run_rank(args)


def run_rank(args) -> int:
    """One process of the job (the only one without --nproc or torchrun)."""
    import torch

    from . import dist
    from .config import TrainConfig
    from .job import Trainer

    from .. import cuda_sync

    try:  # before anything touches CUDA
        waits = cuda_sync.apply()
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if hasattr(signal, "SIGUSR1") and sys.__stderr__ is not None:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)  # `kill -USR1 PID`: where it waits
    world = max(dist.env_world(), args.nproc)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = dist.local_device(device)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    skip = ("device", "dtype", "dims", "partition")
    kw = {k: getattr(args, k) for k in args._fields if hasattr(args, k) and k not in skip}
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0 and cuda_sync.policy() != "auto":
        print(waits, flush=True)
    if args.profile:  # before the model is built: a folder it cannot write is said at once
        try:
            os.makedirs(args.profile, exist_ok=True)
        except OSError as e:
            print(f"error: --profile {args.profile}: {e.strerror}", file=sys.stderr)
            return 2
    try:
        partition = [int(x) for x in args.partition.split(",")] if args.partition else None
        cfg = TrainConfig(**kw, device=device, dtype=dtype, dims=_dims(args, world),
                          partition=partition)
        dist.init(device, cfg.timeout_s)
        tr = Trainer(cfg, log=(lambda s: print(s, flush=True)) if rank0 else None)
        if args.colocate and not tr.colo.wait_connected(10.0):
            print(f"warning: no arbiter at {args.colocate} yet; training unlimited until it answers", file=sys.stderr)
        recs = tr.run()
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        dist.close(wait=False)
        return 2
    if args.json and rank0:
        with open(args.json, "w") as f:
            json.dump({"config": vars(tr.cfg), "steps": recs, "abandoned": tr.colo.abandoned,
                       "paused_s": tr.colo.paused_s, "yielded_s": tr.colo.yielded_s}, f, indent=1, default=str)
    tr.close()
    dist.close()
    return 0
