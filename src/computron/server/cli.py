"""Command line of the server: ``computron serve``, ``ps``, ``tokenizer`` and ``bench serve``.

The top-level CLI calls ``add_parsers(subparsers)`` and ``add_bench_parser(bench_subparsers)``;
each sub-command sets ``func`` (``args -> exit code``). ``main(argv)`` is a stand-alone entry
point with the same sub-commands (``python -m computron.server.cli serve``).

Precedence for ``serve``: flags, then the environment (``COMPUTRON_API_KEY``), then the YAML
file, then the defaults. With no model named anywhere it serves the embedded default: the three
tiny presets under a budget that holds only one of them at a time, so swaps happen.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..config import ComputronConfig, ModelSpec, format_bytes, load_config, parse_bytes, parse_stripe_devices

log = logging.getLogger("computron.server")

DEFAULT_MODELS = ("tiny-opt", "tiny-llama", "tiny-gpt2")
# One tiny model (~0.65 MB) plus the KV cache of one full 512-token context fits; two models do not.
DEFAULT_BUDGET = 1_350_000
DEFAULT_WORKSPACE = 100_000


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API",
                              description="Serve models over an OpenAI-compatible HTTP API. Flags override the "
                                          "YAML file, which overrides the defaults.")
    p.add_argument("--config", metavar="FILE.yaml", help="configuration file (engine, server, models sections)")
    p.add_argument("--model", action="append", metavar="NAME_OR_DIR[=ALIAS][@tp=N,pp=N,devices=A+B]",
                   help="a preset or checkpoint directory to serve (repeat for several), with an optional "
                        "parallel layout; replaces the file's list")
    p.add_argument("--gpu-memory-budget", metavar="SIZE", help="device memory for weights + KV cache, e.g. 40GiB")
    p.add_argument("--workspace", metavar="SIZE", help="part of the budget reserved for activations")
    p.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--policy", choices=("default", "preempt", "slo", "computron"),
                   help="scheduling and swap policy (preempt: a request kept waiting --max-wait seconds by "
                        "other models' running requests preempts them; slo: earliest deadline first under "
                        "per-model SLOs, engine.slos in the config file)")
    p.add_argument("--max-wait", type=float, metavar="SECONDS",
                   help="preempt and slo policies' bound on waiting (default 1)")
    p.add_argument("--slo-scale", type=float, metavar="K",
                   help="slo policy: a model without an SLO in the config gets K times its solo figures (default 5)")
    p.add_argument("--slo-calibration", metavar="NAME|FILE",
                   help="slo policy: where the solo figures come from: a built-in calibration (cpu, h200-rough; "
                        "the default: the one of the device kind) or a file of `computron bench calibrate` (--serve: measured through the "
                        "server, the closest to what clients see)")
    p.add_argument("--preempt-keep-kv", action="store_true", default=None,
                   help="preempt policy: stopped requests keep their caches on the device while their memory "
                        "is not needed, instead of recomputing them")
    p.add_argument("--kv-host", metavar="SIZE",
                   help="preempt (with --preempt-keep-kv) and slo policies: host memory the caches of stopped "
                        "requests may move to when their device memory is needed, e.g. 8GiB (default 0: off)")
    p.add_argument("--decode-steps", type=int, metavar="K",
                   help="decode steps a steady batch runs per engine call, fed on the device (default 1); "
                        "tokens stream K at a time and a new request waits for the run to end")
    p.add_argument("--models-per-step", type=int, metavar="N",
                   help="batches of different models one step runs together on a device, their decode graphs "
                        "replayed at once on separate streams (default 1: one model a step)")
    p.add_argument("--devices", type=int, metavar="N", help="devices to serve on, one worker process each "
                                                             "(executor workers; default: what the layouts need)")
    p.add_argument("--workers-listen", metavar="HOST:PORT",
                   help="executor workers over several nodes: accept the workers of other nodes here "
                        "(`computron worker --connect HOST:PORT`; default $COMPUTRON_WORKERS_LISTEN)")
    p.add_argument("--local-devices", type=int, metavar="N",
                   help="with --workers-listen: devices 0..N-1 are this node's (default $COMPUTRON_LOCAL_DEVICES)")
    p.add_argument("--stripe-devices", metavar="I,J,...",
                   help="GPUs whose host links swap-ins of one-device models pull through too (striped swap): "
                        "with executor inprocess, GPUs this server does not otherwise use; with workers, its own "
                        "devices, lent to a load while they have none in flight")
    p.add_argument("--executor", choices=("inprocess", "legacy", "workers"),
                   help="inprocess (default), legacy (the computron policy's) or workers (a process per device)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the server)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                                     "(default: $COMPUTRON_API_KEY)")
    p.add_argument("--admin-key", help="turn the /admin routes on, behind 'Authorization: Bearer KEY' "
                                       "(default: $COMPUTRON_ADMIN_KEY; without one they answer 403)")
    p.add_argument("--max-body", metavar="SIZE", help="largest request body; larger ones get 413 (default 8MiB)")
    p.add_argument("--host-memory-budget", metavar="SIZE",
                   help="host memory all models may take; run-time registrations beyond it get 409 "
                        "(default: 80%% of the machine's memory)")
    p.add_argument("--max-queue", type=int, metavar="N", help="requests waiting per model before 429 (default 256)")
    p.add_argument("--model-dir", action="append", metavar="DIR",
                   help="directory whose checkpoints may be registered at run time (repeat for several)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    __import__("computron.colocate.serving", fromlist=["add_arguments"]).add_arguments(p)  # --colocate ADDRESS
    p.set_defaults(func=serve_main)

    q = subparsers.add_parser("ps", help="list the models of a running server and where each lives",
                              description="List the models of a running server and where each lives.")
    q.add_argument("--url", default=os.environ.get("COMPUTRON_URL", "http://127.0.0.1:8000"),
                   help="server address (default $COMPUTRON_URL or http://127.0.0.1:8000)")
    q.add_argument("--api-key", default=None, help="API key (default $COMPUTRON_API_KEY)")
    q.add_argument("--json", action="store_true", help="print the raw JSON instead of a table")
    q.set_defaults(func=_ps)

    t = subparsers.add_parser("tokenizer", help="write a preset's tokenizer directory (for clients that count tokens)",
                              description="Write the tokenizer a preset is served with (tokenizer.json, "
                                          "tokenizer_config.json) to a directory that tokenizers.Tokenizer.from_file "
                                          "and transformers.AutoTokenizer.from_pretrained load.")
    t.add_argument("preset", help="preset name (or an alias of one)")
    t.add_argument("--out", required=True, metavar="DIR", help="directory to write (created if needed)")
    t.set_defaults(func=_tokenizer)


def add_bench_parser(bench_subparsers) -> None:
    from .bench import add_parser

    add_parser(bench_subparsers)


def _ps(args) -> int:
    from .ps import ps_main

    return ps_main(args)


def _tokenizer(args) -> int:
    from ..models import get_preset
    from ..models.preset_tokenizer import write_tokenizer

    try:
        cfg = get_preset(args.preset)
        out = write_tokenizer(cfg, args.out)
    except (KeyError, ValueError, OSError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    print(f"{cfg.name}: tokenizer written to {out}")
    return 0


def build_config(args) -> ComputronConfig:
    """The configuration ``serve`` runs with: defaults < YAML file < environment < flags."""
    cfg = load_config(getattr(args, "config", None))
    eng, srv = cfg.engine, cfg.server
    if args.model:
        cfg.models = [ModelSpec.parse(m) for m in args.model]
    if args.device is not None:
        eng.device = args.device
    if args.policy is not None:
        eng.policy = args.policy
    if args.max_wait is not None:
        eng.max_wait_s = args.max_wait
    if getattr(args, "slo_scale", None) is not None:
        if not args.slo_scale > 0:
            raise ValueError(f"--slo-scale must be > 0, got {args.slo_scale}")
        eng.slo_scale = args.slo_scale
    if getattr(args, "slo_calibration", None) is not None:
        eng.slo_calibration = args.slo_calibration
    if getattr(args, "preempt_keep_kv", None):
        eng.preempt_keeps_kv = True
    if getattr(args, "kv_host", None) is not None:
        eng.kv_host_bytes = parse_bytes(args.kv_host)
    if getattr(args, "executor", None) is not None:
        eng.executor = args.executor
    if getattr(args, "decode_steps", None) is not None:
        eng.decode_steps = args.decode_steps
    if getattr(args, "models_per_step", None) is not None:
        eng.models_per_step = args.models_per_step
    if getattr(args, "devices", None) is not None:
        eng.devices = args.devices
    if getattr(args, "stripe_devices", None):
        eng.stripe_devices = parse_stripe_devices(args.stripe_devices)
    for name in ("workers_listen", "local_devices"):
        if getattr(args, name, None) is not None:
            setattr(eng, name, getattr(args, name))
    if args.gpu_memory_budget is not None:
        eng.gpu_memory_budget = parse_bytes(args.gpu_memory_budget)
    if args.workspace is not None:
        eng.workspace_bytes = parse_bytes(args.workspace)
    if args.host is not None:
        srv.host = args.host
    if args.port is not None:
        srv.port = args.port
    key = args.api_key if args.api_key is not None else os.environ.get("COMPUTRON_API_KEY")
    if key:
        srv.api_key = key
    admin = getattr(args, "admin_key", None) or os.environ.get("COMPUTRON_ADMIN_KEY")
    if admin:
        srv.admin_key = admin
    if getattr(args, "max_body", None) is not None:
        srv.max_body_bytes = parse_bytes(args.max_body)
    if getattr(args, "host_memory_budget", None) is not None:
        srv.host_memory_budget = parse_bytes(args.host_memory_budget)
    if args.max_queue is not None:
        srv.max_queue = args.max_queue
    if args.model_dir:
        srv.model_dirs = list(args.model_dir)
    if srv.max_queue < 1:
        raise ValueError(f"max_queue must be at least 1, got {srv.max_queue}")
    eng.__post_init__()  # flags are checked as the file's values are
    if not cfg.models:  # the embedded default
        cfg.models = [ModelSpec(m) for m in DEFAULT_MODELS]
        if eng.gpu_memory_budget is None:
            eng.gpu_memory_budget = DEFAULT_BUDGET
            if eng.workspace_bytes is None:
                eng.workspace_bytes = DEFAULT_WORKSPACE
    need = max(m.world for m in cfg.models)
    if need > 1 and eng.executor is None:  # a layout over several devices needs a worker per device
        eng.executor, eng.devices = "workers", max(eng.devices, need)
    names = [m.name for m in cfg.models]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"model name(s) given twice: {', '.join(dup)}; give one an alias (NAME_OR_DIR=ALIAS)")
    if eng.kv_host_bytes and not (eng.policy == "slo" or eng.policy == "preempt" and eng.preempt_keeps_kv):
        raise ValueError(f"--kv-host (kv_host_bytes) moves the caches of stopped requests, which only the slo "
                         f"policy and the preempt policy with --preempt-keep-kv keep; policy {eng.policy!r} "
                         f"would never use it")
    return cfg


def setup_logging(level: str = "info") -> None:
    from rich.logging import RichHandler

    handler = RichHandler(show_path=False, log_time_format="[%X]")
    for name in ("computron", "uvicorn"):  # uvicorn's own lines look the same (it runs with log_config=None)
        logger = logging.getLogger(name)
        if not any(isinstance(h, RichHandler) for h in logger.handlers):
            logger.addHandler(handler)
        logger.setLevel(level.upper())
        logger.propagate = False


def _check_port(host: str, port: int) -> None:
    """ValueError when the address cannot be bound (in use, or not this machine's)."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def serve_main(args) -> int:
    setup_logging(args.log_level)
    try:
        cfg = build_config(args)
        from ..models import resolve_model

        for spec in cfg.models:  # fail now on a typo rather than after the server started
            resolve_model(spec.source, spec.dtype)
        if cfg.engine.policy == "slo":  # likewise a calibration the SLOs cannot be read from
            from ..sim.costs import calibration

            if cfg.engine.slo_calibration is not None:
                calibration(cfg.engine.slo_calibration)
        from .. import cuda_sync

        waits = cuda_sync.apply()  # before the engine first uses CUDA
        if cuda_sync.policy() != "auto":
            log.info("%s", waits)
        _check_port(cfg.server.host, cfg.server.port)  # before building host images, not after
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as e:
        print(f"computron serve: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    import uvicorn

    from ..engine import AsyncEngine, Engine, EngineError
    from .app import create_app
    from .background import uvicorn_config

    try:
        engine = Engine(cfg.engine)
    except (EngineError, ValueError) as e:
        print(f"computron serve: {e}", file=sys.stderr)
        return 2
    srv = cfg.server
    for d in engine.memory()["devices"]:
        log.info("engine on %s, memory budget %s (%s for weights and KV cache), policy %s", d["device"],
                 format_bytes(d["budget"]), format_bytes(d["capacity"]), cfg.engine.policy)
    if srv.host not in ("127.0.0.1", "localhost", "::1") and not srv.api_key:
        log.warning("listening on %s without an API key: anyone who can reach it can use it", srv.host)
    ae = AsyncEngine(engine)
    colocation = None
    try:
        colocation = __import__("computron.colocate.serving", fromlist=["attach"]).attach(args, ae)
        app = create_app(ae, cfg, colocation)
        log.info("serving %d model(s) on http://%s:%d (OpenAI API under /v1)", len(cfg.models), srv.host, srv.port)
        server = uvicorn.Server(uvicorn_config(app, srv.host, srv.port, log_level=args.log_level,
                                               log_config=None, timeout_graceful_shutdown=10))
        try:
            server.run()
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, once shut down
            pass
        return 0 if server.started else 1
    finally:
        if colocation is not None:
            colocation.close()
        ae.shutdown()
        engine.executor.shutdown()  # release the device (worker processes would also leave on the pipe's EOF)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="computron")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parsers(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    add_bench_parser(bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
