"""The worker process's loop: one per device, in the child, serving an executor from a pipe.

A worker (started by ``WorkerExecutor``, ``engine/workers.py``) joins the torch.distributed world
when there are several devices (rank = device; NCCL on GPUs, gloo on the CPU), builds the
executor that does the work (the ``InProcessExecutor``, or the ``LegacyExecutor`` for the
``computron`` policy) on its device, and answers protocol calls until ``shutdown`` or until the
parent goes away (EOF on the pipe). Everything it holds (host images, arena, KV caches) lives in
this process.

Messages, parent -> worker: ``(id, call, args)``; ``id`` None means no reply is wanted (``free``,
``step``). Worker -> parent: ``(id, "ok", value)``, ``(id, "err", type name, base name, message)``
or an interim ``(id, "progress", text)``. Id 0 is the start-up reply. A ``step`` answers
``("ok", StepResult)`` or ``("err", ...)`` on a pipe of its own, read by the engine's thread.
``register`` runs on a thread, so steps keep being served while a model is built.

With ``config.run_ahead`` the executor is the ``RunAheadExecutor`` (``ahead.py``): a step the engine
expects to be followed by the same batch one token on starts that next step before the engine asks
(on the CPU just after the answer is sent); any call but a step first drops such a step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger("computron.workers")

# Exceptions cross as (type name, nearest of these bases, message); the parent rebuilds them.
BASES = (KeyError, FileNotFoundError, ValueError, MemoryError, TimeoutError, RuntimeError)


def error_reply(rid, e: BaseException) -> tuple:
    base = next((b for b in BASES if isinstance(e, b)), RuntimeError)
    msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return (rid, "err", type(e).__name__, base.__name__, msg)


def worker_main(conn, config, device: int, world: int = 1, port: int = 0, steps=None, master: str = "127.0.0.1",
                local: int | None = None) -> bool:
    """A worker's loop: answer protocol calls from the pipe until ``shutdown`` or the parent goes away.
    With several devices the workers first join one torch.distributed world (rank = device; NCCL on
    GPUs, gloo on the CPU; its store at ``master``:``port``), in which each model's process groups
    are made when it is registered. ``local``: the GPU of this node that ``device`` is (a worker of
    another node); default: the same number. ``steps`` None: step answers go on ``conn`` too.
    Returns True when told to shut down, False when the engine went away or it could not start."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it shuts us down
    send_lock = threading.Lock()

    def send(msg) -> None:
        with send_lock:
            conn.send(msg)

    try:
        from .. import cuda_sync

        cuda_sync.apply()  # each process's own contexts (the parent checked the value)
        if world > 1:
            import datetime

            import torch
            import torch.distributed as dist

            # NVLink multicast (NVLS) buys nothing here and can take a shared host's GPUs down: off.
            for var, off in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
                os.environ.setdefault(var, off)
            backend = "nccl" if config.device != "cpu" and torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(device if local is None else local)
            dist.init_process_group(backend, init_method=f"tcp://{master}:{port}", rank=device, world_size=world,
                                    timeout=datetime.timedelta(seconds=120))
        if config.executor == "legacy":  # the original Computron's mechanics, a rank per worker
            from .legacy import LegacyExecutor as kind
        elif config.run_ahead:  # the in-process executor, plus a decode step run ahead
            from .ahead import RunAheadExecutor as kind
        else:
            from .inprocess import InProcessExecutor as kind
        if local is None or local == device or config.device == "cpu":
            ex = kind(config, index=device, world=world)
        else:  # built on this node's GPU ``local``; known to placements as ``device``
            ex = kind(config, index=local, world=world)
            ex.index = device
    except BaseException as e:
        send(error_reply(0, e))
        return False
    send((0, "ok", None))
    run_ahead, drop_ahead = getattr(ex, "run_ahead", None), getattr(ex, "drop_ahead", None)

    def step(args: tuple) -> None:
        """A step answers on its own pipe, read by the engine's thread itself (no hop through the
        parent's receiver thread: the step is the hot path)."""
        try:
            reply = ("ok", ex.execute(*args).result())
        except BaseException as e:
            reply = error_reply(None, e)[1:]
        if steps is None:
            send((None, "step", reply))
        else:
            steps.send(reply)
        if run_ahead is not None:
            run_ahead()  # while the engine takes the answer in and plans its next step

    def serve(rid, name: str, args: tuple) -> None:
        try:
            if name == "register":
                value = ex.register(args[0], (lambda text: send((rid, "progress", text))) if args[1] else None)
            elif name == "execute":
                value = ex.execute(*args).result()
            else:
                value = getattr(ex, name)(*args)
            if rid is not None:
                send((rid, "ok", value))
        except BaseException as e:
            if rid is not None:
                send(error_reply(rid, e))
            else:
                log.exception("worker for device %d: %s failed", device, name)

    def leave() -> None:
        """Tear the process group down before exiting (else NCCL's watchdog reports the store gone)."""
        if world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 -- exiting anyway
                    pass

    while True:
        try:
            rid, name, args = conn.recv()
        except (EOFError, OSError):  # the parent died or closed the pipe: nothing more to serve
            if drop_ahead is not None:
                drop_ahead()
            ex.shutdown()
            leave()
            return False
        if name != "step" and drop_ahead is not None:
            drop_ahead()  # any other call comes between steps: the step run ahead is not the next one
        if name == "register":  # slow: build the host image while steps go on
            threading.Thread(target=serve, args=(rid, name, args), daemon=True).start()
        elif name == "step":
            step(args)
        else:
            serve(rid, name, args)
            if name == "shutdown":
                leave()
                return True


def connect_main(address: tuple[str, int], authkey: bytes, device: int | None = None, local: int = 0,
                 timeout: float = 300.0) -> int:
    """A worker of another node: connect to the engine's control channel (``address``, authenticated
    with ``authkey``: an HMAC challenge both ways before anything is unpickled), ask for ``device``
    (None: the engine's choice), join its process group and serve. Returns the exit code: 0 after
    the engine shut it down; 3 when the engine closed the connection (it is restarting its world:
    a launcher such as ``torchrun --max-restarts`` starts the worker again) or refused it; 2 when
    the engine could not be reached within ``timeout`` seconds."""
    import socket
    import time
    from multiprocessing.connection import AuthenticationError, Client

    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = Client(address, authkey=authkey)
            break
        except AuthenticationError as e:
            log.error("the engine at %s:%d refused this worker: %s (is COMPUTRON_WORKER_AUTHKEY the same on "
                      "both sides?)", *address, e)
            return 2
        except OSError as e:
            if time.monotonic() > deadline:
                log.error("could not reach the engine at %s:%d within %.0f s: %s", *address, timeout, e)
                return 2
            time.sleep(0.2)
    with conn:
        conn.send(("hello", device, os.getpid(), socket.gethostname()))
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            log.error("the engine at %s:%d closed the connection before assigning a device", *address)
            return 3
        if msg[0] != "assign":
            log.error("the engine at %s:%d refused this worker: %s", *address, msg[1])
            return 3
        _, config, device, world, master, port = msg
        log.info("worker for device %d of %d (process group at %s:%d)", device, world, master, port)
        return 0 if worker_main(conn, config, device, world, port, None, master, local) else 3
