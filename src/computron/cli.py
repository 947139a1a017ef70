"""The ``computron`` command: serve | ps | generate | worker | bench | plan | sim | loadgen | train.

Each sub-command's parser lives next to the code it runs; this file only assembles them.
"""

from __future__ import annotations

import argparse
import sys


def _generate(args) -> int:
    from .config import EngineConfig, ModelSpec
    from .engine import Engine, EngineError, SamplingParams

    eng = None
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, stop=tuple(args.stop or ()))
        spec = ModelSpec.parse(args.model)
        spec.tp, spec.pp = args.tp or spec.tp, args.pp or spec.pp
        eng = Engine(EngineConfig(device=args.device, gpu_memory_budget=args.gpu_memory_budget,
                                  executor="workers" if spec.world > 1 else None, devices=spec.world))
        eng.register_model(spec, progress=lambda m: print(m, file=sys.stderr))
        req = eng.submit(spec.name, args.prompt, params, on_update=lambda r, t: print(t, end="", flush=True))
        eng.run_until_done([req])
    except (EngineError, ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    finally:
        if eng is not None:
            eng.executor.shutdown()  # worker processes, when there are any
    print()
    if req.error:
        print(f"error: {req.error}", file=sys.stderr)
        return 1
    print(f"[{len(req.output_ids)} tokens, finish_reason={req.finish_reason}]", file=sys.stderr)
    return 0


def _worker(args) -> int:
    """A worker of another node: joins the engine's process group and serves its control channel."""
    import logging
    import os

    from .engine.worker_loop import connect_main
    from .engine.workers_remote import parse_address

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    key = os.environ.get("COMPUTRON_WORKER_AUTHKEY", "")
    if not key:
        print("error: set COMPUTRON_WORKER_AUTHKEY to the engine's key", file=sys.stderr)
        return 2
    try:
        address = parse_address(args.connect)
    except ValueError as e:
        print(f"error: --connect: {e}", file=sys.stderr)
        return 2
    local = int(os.environ.get("LOCAL_RANK", "0"))  # set by torchrun: this process's GPU on its node
    device = args.device
    if device is None and args.first_device is not None:
        device = args.first_device + int(os.environ.get("RANK", "0"))
    return connect_main(address, key.encode(), device, local, args.connect_timeout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="computron", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with one model")
    g.add_argument("--model", default="tiny-opt", help="preset name or checkpoint directory, with an optional "
                                                       "layout: NAME@tp=N,pp=N,devices=A+B")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (one worker process per device)")
    g.add_argument("--pp", type=int, default=None, help="pipeline stages")
    g.add_argument("--device", default="auto")
    g.add_argument("--gpu-memory-budget", default=None)
    g.set_defaults(func=_generate)

    w = sub.add_parser("worker", help="a worker of another node, joining a running engine (run it with torchrun)")
    w.add_argument("--connect", required=True, metavar="HOST:PORT",
                   help="the engine's worker channel (its COMPUTRON_WORKERS_LISTEN)")
    w.add_argument("--first-device", type=int, default=None,
                   help="device of this launch's rank 0; each process asks for it plus its RANK")
    w.add_argument("--device", type=int, default=None, help="the device to serve (default: the engine's choice)")
    w.add_argument("--connect-timeout", type=float, default=300.0, help="seconds to keep trying to reach the engine")
    w.set_defaults(func=_worker)

    from .bench import cli as bench_cli

    b = sub.add_parser("bench", help="benchmarks (results as JSON under bench/results/)")
    bsub = b.add_subparsers(dest="bench", required=True)
    bench_cli.add_parsers(bsub)

    from .server import cli as server_cli

    server_cli.add_parsers(sub)
    server_cli.add_bench_parser(bsub)
    __import__("computron.train.accuracy_cli", fromlist=["add_bench_parser"]).add_bench_parser(bsub)
    __import__("computron.colocate.hybrid_cli", fromlist=["add_bench_parser"]).add_bench_parser(bsub)

    from .planner import cli as planner_cli

    planner_cli.add_parser(sub)

    from .sim import cli as sim_cli

    sim_cli.add_parser(sub)

    from .workload import loadgen

    loadgen.add_parser(sub)
    __import__("computron.train.cli", fromlist=["add_parser"]).add_parser(sub)
    __import__("computron.colocate.cli", fromlist=["add_parser"]).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
