"""``computron train``: train a decoder of this project (a preset or a checkpoint) on a text file or
synthetic tokens, optionally colocated with an inference server (``--colocate ADDRESS``)."""

from __future__ import annotations

import json
import sys
from dataclasses import fields


def add_parser(sub) -> None:
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
                   help="auto: bfloat16 autocast on the GPU, float32 on the CPU")
    p.add_argument("--checkpoint", default=None, help="directory for safetensors checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint when it holds one")
    p.add_argument("--colocate", default=None, metavar="ADDRESS", help="the arbiter's socket path or host:port")
    p.add_argument("--colocate-device", type=int, default=0)
    p.add_argument("--json", default=None, help="write per-step records to this JSON file")
    p.set_defaults(func=run, _fields=[f.name for f in fields(TrainConfig)])


def run(args) -> int:
    import torch

    from .config import TrainConfig
    from .job import Trainer

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    kw = {k: getattr(args, k) for k in args._fields if hasattr(args, k) and k not in ("device", "dtype", "dims")}
    try:
        tr = Trainer(TrainConfig(**kw, device=device, dtype=dtype), log=lambda s: print(s, flush=True))
        if args.colocate and not tr.colo.wait_connected(10.0):
            print(f"warning: no arbiter at {args.colocate} yet; training unlimited until it answers", file=sys.stderr)
        recs = tr.run()
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(tr.cfg), "steps": recs, "abandoned": tr.colo.abandoned,
                       "paused_s": tr.colo.paused_s}, f, indent=1, default=str)
    tr.colo.close()
    return 0
