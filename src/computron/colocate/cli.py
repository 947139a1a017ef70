"""``computron colocate``: one command starts a server and a training job that share the devices.

The server is ``computron serve SERVE_ARGS --colocate ADDRESS --colocate-mode MODE ...`` and the job
``computron train TRAIN_ARGS --colocate ADDRESS``, each a process of its own (their output
interleaves). When the job ends the server keeps serving; Ctrl-C (or SIGTERM) stops both; if the
server exits, the job is stopped too and the server's exit status is returned.

The defaults are the configuration that met both of colocation's targets on one H200 (under CUDA
MPS, ``bench/results/handover_h200_s42/README.md``): the job yields the compute while a request
waits for its first token, and allocates through ``cudaMallocAsync``, whose pool a handover trims to
the new limit (14.5 ms at p99 for 2.45 GiB, against 20-35 ms with PyTorch's caching allocator).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from .arbiter import MODES, YIELDS
from .protocol import family

ALLOCATORS = ("async", "native")
ASYNC_CONF = "backend:cudaMallocAsync"


def add_parser(sub) -> None:
    p = sub.add_parser("colocate", help="serve models and train on the same devices, memory handed over by an arbiter",
                       description=__doc__.splitlines()[0])
    p.add_argument("--serve", default="", metavar="'ARGS'", help="arguments of `computron serve`, one string")
    p.add_argument("--train", default="", metavar="'ARGS'", help="arguments of `computron train`, one string")
    p.add_argument("--mode", choices=MODES, default="colocate")
    p.add_argument("--idle", type=float, default=1.0, help="seconds inference idles before memory goes back")
    p.add_argument("--static-train", default="0", metavar="SIZE", help="static mode: training's share")
    p.add_argument("--at-boundary", action="store_true", help="training releases at its next micro-batch boundary")
    p.add_argument("--yield", dest="yield_compute", choices=YIELDS, default="first-token",
                   help="training yields the GPU's compute while inference has work (work), while a request waits "
                        "for its first token (first-token, the default), while a request that found its model "
                        "off the device waits for it (cold), or never (none)")
    p.add_argument("--job-allocator", choices=ALLOCATORS, default="async",
                   help="the job's CUDA allocator: cudaMallocAsync (async, the default: a handover trims its pool "
                        "to the limit) or PyTorch's caching allocator (native). A PYTORCH_CUDA_ALLOC_CONF in the "
                        "environment is kept as it is")
    p.add_argument("--mps", action="store_true",
                   help="run both processes as clients of a CUDA MPS server of their own (nvidia-cuda-mps-control, "
                        "started here and told to quit at the end), so that their kernels share the SMs instead of "
                        "taking turns in time slices: the setting the defaults were measured in")
    p.add_argument("--address", default=None, help="the arbiter's socket (default: a fresh Unix socket path)")
    p.set_defaults(func=run)


def commands(args, address: str) -> tuple[list[str], list[str]]:
    """The two command lines ``computron colocate`` runs."""
    base = [sys.executable, "-m", "computron.cli"]
    serve = base + ["serve", *shlex.split(args.serve), "--colocate", address, "--colocate-mode", args.mode,
                    "--colocate-idle", str(args.idle), "--colocate-static-train", str(args.static_train),
                    "--colocate-yield", args.yield_compute]
    if args.at_boundary:
        serve.append("--colocate-at-boundary")
    train = base + ["train", *shlex.split(args.train), "--colocate", address]
    return serve, train


def job_env(allocator: str, env: dict[str, str]) -> dict[str, str]:
    """The training job's environment: ``env`` with the allocator asked for, unless ``env`` already
    configures PyTorch's CUDA allocator (then it is left as it is)."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"unknown allocator {allocator!r}; known: {', '.join(ALLOCATORS)}")
    if allocator == "native" or "PYTORCH_CUDA_ALLOC_CONF" in env:
        return dict(env)
    return {**env, "PYTORCH_CUDA_ALLOC_CONF": ASYNC_CONF}


def stop_all(procs: list[subprocess.Popen], timeout: float = 20.0) -> list[int]:
    """Ctrl-C to every process at once, then the ones still running after ``timeout`` seconds killed:
    each gets its signal without waiting for another to end, and the whole stop takes ``timeout`` at
    most, however many ignore it. Their exit statuses, in order."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]


def _own_sigint() -> None:
    """In each child before it runs: Ctrl-C back to its default. A command started in the background
    (``&``) ignores SIGINT, and its children would inherit that and ignore the Ctrl-C that stops
    them; this one's children are stopped by it, so they must hear it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


MPS_CONTROL = "nvidia-cuda-mps-control"


def start_mps(env: dict[str, str]) -> dict[str, str]:
    """Start a CUDA MPS control daemon with pipe and log folders of its own (only processes given them
    connect to it; the GPU's settings are left as they are): ``env`` with those folders, for the clients.
    Raises RuntimeError with the reason where it cannot."""
    exe = shutil.which(MPS_CONTROL, path=env.get("PATH"))
    if exe is None:
        raise RuntimeError(f"--mps: no {MPS_CONTROL} on PATH (it comes with the NVIDIA driver)")
    mps = {**env, "CUDA_MPS_PIPE_DIRECTORY": tempfile.mkdtemp(prefix="computron-mps-pipe-"),
           "CUDA_MPS_LOG_DIRECTORY": tempfile.mkdtemp(prefix="computron-mps-log-")}
    done = subprocess.run([exe, "-d"], env=mps, capture_output=True, text=True, timeout=60)
    if done.returncode:
        why = (done.stderr or done.stdout).strip()
        raise RuntimeError(f"--mps: {MPS_CONTROL} -d failed ({done.returncode}): {why}")
    return mps


def stop_mps(env: dict[str, str]) -> None:
    """Tell the daemon ``start_mps`` started (the folders in ``env``) to quit."""
    exe = shutil.which(MPS_CONTROL, path=env.get("PATH"))
    if exe is not None:
        subprocess.run([exe], input="quit\n", env=env, capture_output=True, text=True, timeout=60)


def run(args) -> int:
    env = dict(os.environ)
    if args.mps:
        try:
            env = start_mps(env)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            print(f"computron colocate: {e}", file=sys.stderr)
            return 2
        print(f"computron colocate: an MPS server for both processes ({env['CUDA_MPS_PIPE_DIRECTORY']})",
              file=sys.stderr)
    try:
        return _run(args, env)
    finally:
        if args.mps:
            stop_mps(env)


def _run(args, env: dict[str, str]) -> int:
    address = args.address or os.path.join(tempfile.mkdtemp(prefix="computron-colocate-"), "arbiter.sock")
    serve_cmd, train_cmd = commands(args, address)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    server = subprocess.Popen(serve_cmd, preexec_fn=_own_sigint, env=env)
    trainer = None
    try:
        # a Unix socket: start the job once the server listens (a TCP one: the job finds it later)
        unix = family(address)[0] == socket.AF_UNIX
        while unix and not os.path.exists(address) and server.poll() is None and not stop:
            time.sleep(0.1)
        if server.poll() is None and not stop:
            if args.job_allocator == "async" and "PYTORCH_CUDA_ALLOC_CONF" in env:
                print(f"computron colocate: the job keeps PYTORCH_CUDA_ALLOC_CONF="
                      f"{env['PYTORCH_CUDA_ALLOC_CONF']} from the environment", file=sys.stderr)
            trainer = subprocess.Popen(train_cmd, preexec_fn=_own_sigint, env=job_env(args.job_allocator, env))
        while server.poll() is None and not stop:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        rc = stop_all([server] + ([trainer] if trainer is not None else []))[0]
    return 0 if stop else rc
