"""The process layout of a parallel training job: ranks, their process groups, and starting them.

What flows through: a ``ParallelDims`` and the process's global rank become a :class:`Mesh`, the
rank's place in the layout and its groups. Global rank ``r = stage * dp*tp + d * tp + t``, the
planner's (and Megatron-LM's) order (``planner/layout.py``): tensor groups are consecutive ranks,
inside one node, and a stage is a contiguous block of ranks, so a plan's placement of stages on
nodes holds as written. Within a replica, the sharding plan's rank is ``stage * tp + t``. Groups: ``tp`` (same replica and stage),
``pp`` (same replica and tensor rank, the pipeline), ``dp`` (same model-parallel rank), and
``embed`` (first and last stage of one pipeline: a tied embedding's two copies).

Processes come from :func:`spawn` (``computron train --nproc N``, one machine) or from
``torchrun`` (several nodes): either way each process finds ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in its environment, and :func:`init` joins the
group (NCCL on GPUs, gloo on the CPU) with a timeout on every collective, so a rank that dies
fails its peers with an error instead of leaving them waiting. :func:`spawn` ends the job as soon
as one rank exits with an error and says which one.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..parallel.dims import ParallelDims


@dataclass
class Mesh:
    dims: ParallelDims
    rank: int = 0
    d: int = 0  # data-parallel replica
    stage: int = 0
    t: int = 0  # tensor rank
    tp: object = None  # process groups (None: one rank, or a world of one)
    pp: object = None
    dp: object = None
    embed: object = None

    @property
    def distributed(self) -> bool:
        return self.dims.world_size > 1

    @classmethod
    def build(cls, dims: ParallelDims, timeout_s: float) -> "Mesh":
        """This process's place in ``dims``; creates every group (collective: all ranks call it), each
        collective on them failing after ``timeout_s``."""
        if dims.world_size == 1:
            return cls(dims)
        if not dist.is_initialized():
            raise ValueError(f"{dims} needs {dims.world_size} processes: start it with --nproc or torchrun")
        if dist.get_world_size() != dims.world_size:
            raise ValueError(f"{dims} needs {dims.world_size} processes, the job has {dist.get_world_size()}")
        rank, dp, tp, pp = dist.get_rank(), dims.dp, dims.tp, dims.pp
        stage, rest = divmod(rank, dp * tp)
        d, t = divmod(rest, tp)

        def at(s: int, e: int, k: int) -> int:
            return s * dp * tp + e * tp + k

        def mine(lists):
            out = None
            for members in lists:
                group = dist.new_group(members, timeout=timedelta(seconds=timeout_s))
                out = group if rank in members else out
            return out

        S, D, T = range(pp), range(dp), range(tp)
        return cls(dims, rank, d, stage, t,
                   tp=mine([[at(s, e, k) for k in T] for s in S for e in D]),
                   pp=mine([[at(s, e, k) for s in S] for e in D for k in T]),
                   dp=mine([[at(s, e, k) for e in D] for s in S for k in T]),
                   embed=mine([[at(0, e, k), at(pp - 1, e, k)] for e in D for k in T]) if pp > 1 else None)


def env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_device(device: str) -> str:
    """The device of this process: ``cuda`` becomes ``cuda:LOCAL_RANK`` in a job of several processes."""
    if device == "cuda" and env_world() > 1:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def init(device: str, timeout_s: float) -> None:
    """Join the job's process group from the environment (NCCL on GPUs, gloo on the CPU)."""
    if env_world() == 1 or dist.is_initialized():
        return
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s),
                            device_id=torch.device(device) if cuda else None)


def close(wait: bool = True) -> None:
    """Leave the group; ``wait``: once every rank is done (a failing rank leaves at once)."""
    if dist.is_initialized():
        if wait:
            dist.barrier()  # no rank tears the group down while a peer still talks to it
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(local_rank: int, nproc: int, port: int, fn, args) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    code = fn(*args)
    if code:
        raise SystemExit(code)
    # Done and the group destroyed: leave without the interpreter's teardown, where a rank once
    # aborted ("terminate called without an active exception", SIGABRT) after finishing its work,
    # a thread of the communication library's still joinable when its static objects were destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankFailed(RuntimeError):
    pass


def _cause(trace: str) -> str:
    """The exceptions a rank's traceback names, the first cause and the last raised (a chain's last line
    alone may be the tail of a long message, saying nothing)."""
    lines = [line.strip() for line in trace.splitlines()]
    raised = []
    for i, line in enumerate(lines):
        if re.match(r"[\w.]*(Error|Exception|Failed)(:|$)", line):  # a message on the next line: join it
            raised.append(" ".join([line] + [x for x in lines[i + 1:i + 2] if x]) if line.endswith(":") else line)
    if not raised:
        return trace.strip().splitlines()[-1] if trace.strip() else "no traceback"
    return raised[-1] if len(raised) == 1 or raised[0] == raised[-1] else f"{raised[-1]} (caused by {raised[0]})"


def spawn(nproc: int, fn, *args) -> None:
    """Run ``fn(*args)`` in ``nproc`` fresh processes on this machine (ranks 0..nproc-1); a rank that
    raises, exits non-zero or dies ends the others and raises :class:`RankFailed` naming it."""
    import torch.multiprocessing as mp

    try:
        mp.start_processes(_entry, args=(nproc, free_port(), fn, args), nprocs=nproc, join=True, start_method="spawn")
    except mp.ProcessRaisedException as e:
        raise RankFailed(f"rank {e.error_index} of {nproc} failed: {_cause(str(e))}") from None
    except mp.ProcessExitedException as e:
        how = f"was killed by signal {e.signal_name}" if e.signal_name else f"exited with code {e.exit_code}"
        raise RankFailed(f"rank {e.error_index} of {nproc} {how}; the job stopped") from None
