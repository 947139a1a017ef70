"""Where one training step's time goes: torch's profiler over a Trainer step on the GPU, the top
operations by device time. The trainer figures in docs/training.md (the head's fallback GEMM, host
time against device time) come from this table.

    PYTHONPATH=src python bench/train_step_profile.py [MODEL] [--micro-batch 8] [--global-batch 32] [--seq-len 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="gpt2")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from computron.train.config import TrainConfig
    from computron.train.job import Trainer

    tr = Trainer(TrainConfig(model=args.model, seq_len=args.seq_len, global_batch=args.global_batch,
                             micro_batch=args.micro_batch, steps=6, device="cuda", dtype="bfloat16",
                             synthetic_tokens=(args.global_batch * 7 + 1) * args.seq_len + 1))
    for _ in range(2):  # warm-up
        tr.train_step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        rec = tr.train_step()
    print(f"profiled step {rec['time_s'] * 1e3:.1f} ms")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
