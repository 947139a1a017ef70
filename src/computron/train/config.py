"""TrainConfig: what ``computron train`` runs (model, data, batch sizes, optimizer, device,
checkpoints, colocation). Torch-free, so the command line can show its defaults without torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    model: str = "tiny-opt"  # preset or checkpoint directory
    data: str | None = None  # a text file; None: synthetic tokens
    seq_len: int = 64
    global_batch: int = 8  # samples per optimizer step
    micro_batch: int = 8  # the largest micro-batch
    steps: int = 10
    lr: float = 3e-4
    weight_decay: float = 0.0
    device: str = "cpu"
    dtype: str = "float32"  # float32, or bfloat16 (bf16 weight copies, float32 masters and gradients)
    seed: int = 0
    synthetic_tokens: int = 1 << 16
    checkpoint: str | None = None  # directory
    checkpoint_every: int = 0  # steps; 0: at the end only
    resume: bool = False
    dims: dict = field(default_factory=dict)  # ParallelDims fields
    zero1: bool = False  # shard AdamW's state over the data-parallel ranks
    virtual_stages: int = 1  # model chunks per pipeline rank (> 1: interleaved 1F1B)
    partition: list | None = None  # layers per pipeline stage (pp * virtual_stages of them); None: uniform
    recompute: bool = False  # full activation recomputation, per layer
    cuda_graphs: bool = False  # each micro-batch's forward, backward and accumulation replayed as one CUDA graph
    timeout_s: float = 300.0  # a collective waiting longer than this fails the job
    colocate: str | None = None  # the arbiter server's address (a socket path or host:port)
    colocate_device: int = 0
    colocate_run_ahead: int = 8  # watched module calls the host may queue ahead of the GPU (0: unbounded)
    # a CUDA event at every this many watched calls (1..run-ahead; None: job.FENCE_EVERY, or the run-ahead when smaller)
    colocate_fence_every: int | None = None
    profile: str | None = None  # a directory for step profiles (train/profile.py); None: none
    profile_at: int | None = None  # profile from this step (1-based); besides, whenever profile/request appears
    profile_steps: int = 3  # steps in a profile window
    profile_trace: bool = False  # also write each window's timeline (chrome trace)
