"""Parsers of ``computron bench swap``, ``round-robin`` and ``decode``, without torch.

Each parser's ``func`` imports its benchmark (and so torch) only when the command runs.
"""

from __future__ import annotations

from .common import positive_int


def _swap(args) -> int:
    from . import swap

    return swap.main(args)


def _round_robin(args) -> int:
    from . import round_robin

    args.policy = args.policy or ["default", "computron"]
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return round_robin.main(args)


def add_swap_parser(sub) -> None:
    p = sub.add_parser("swap", help="swap-in/eviction time against a raw pinned memcpy of the same bytes")
    p.add_argument("model", nargs="+")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--prompt-len", type=positive_int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--executor", choices=("inprocess", "workers"), default="inprocess",
                   help="workers: the same engine behind a worker process per device")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks (implies --executor workers)")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline stages (implies --executor workers)")
    p.add_argument("--no-naive", action="store_true",
                   help="skip the naive baseline (module.to(device) from pageable memory, the slowest part)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None)
    p.set_defaults(func=_swap)


def add_round_robin_parser(sub) -> None:
    p = sub.add_parser("round-robin", help="N copies of a model, R requests round-robin, one copy fits")
    p.add_argument("model")
    p.add_argument("-n", type=positive_int, default=2, help="copies of the model")
    p.add_argument("-r", type=positive_int, default=24, help="requests")
    p.add_argument("--blocking", action="store_true", help="send each request after the previous answered")
    p.add_argument("--policy", action="append", choices=["default", "computron"],
                   help="policy to run (repeat for several; default: both)")
    p.add_argument("--prompt-len", type=positive_int, default=8)
    p.add_argument("--max-tokens", type=positive_int, default=2)
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks of each copy (a worker per device)")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline stages of each copy")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None)
    p.set_defaults(func=_round_robin)


def _decode(args) -> int:
    from . import decode

    return decode.main(args)


def add_decode_parser(sub) -> None:
    p = sub.add_parser("decode", help="decode step time and tokens/s of one resident model by batch size, "
                                      "against the weight-read floor and transformers")
    p.add_argument("model", nargs="+")
    p.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--prompt-len", type=positive_int, default=128)
    p.add_argument("--new-tokens", type=positive_int, default=128)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--decode-steps", type=positive_int, nargs="+", default=[1], metavar="K",
                   help="decode steps per engine call (each value measured, alternating, in the same run)")
    p.add_argument("--no-reference", action="store_true", help="skip transformers' generate")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None)
    p.set_defaults(func=_decode)


def _calibrate(args) -> int:
    from . import calibrate

    return calibrate.main(args)


def _shared_steps_arg(text: str) -> int:
    """``--shared-steps``: 0 (skip) or a number of models of at least 2."""
    import argparse

    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 0 or a whole number of models of at least 2, got {text!r}")
    if k == 1 or k < 0:
        raise argparse.ArgumentTypeError(f"a shared step needs at least 2 models (0 skips it), got {k}")
    return k


def add_calibrate_parser(sub) -> None:
    from .calibrate import __doc__ as doc

    p = sub.add_parser("calibrate", help="measure swap, prefill and decode times for the simulator's cost model",
                       description=doc.split("\n\n")[0])
    p.add_argument("model", nargs="*", default=None,
                   help="models of two or more sizes (default: opt-125m opt-350m opt-1.3b on a GPU, tiny presets on CPU)")
    p.add_argument("--batch", type=positive_int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--prompt", type=positive_int, nargs="+", default=[32, 128, 512])
    p.add_argument("--new-tokens", type=positive_int, default=32)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--gpu-memory-budget", default=None)
    p.add_argument("--executor", choices=("inprocess", "legacy"), default=None,
                   help="the executor to measure (legacy: the computron policy's; default: the default policy's)")
    p.add_argument("--serve", action="store_true",
                   help="time prefill and decode through the HTTP server with loadgen's streamed client (what "
                        "loadgen measures against `computron serve`) instead of on the engine alone")
    p.add_argument("--shared-steps", type=_shared_steps_arg, default=2, metavar="K",
                   help="on a GPU, measure the shared-step fraction (concurrent_step_fraction) with K copies of "
                        "the largest model stepped together against one a step (0: skip, keep 1; default 2)")
    p.add_argument("--out", default="bench/results/calibration.json", help="the calibration file to write")
    p.set_defaults(func=_calibrate)


def add_parsers(sub) -> None:
    """Add ``round-robin``, ``swap``, ``decode`` and ``calibrate`` to a ``bench`` sub-parsers object."""
    add_round_robin_parser(sub)
    add_swap_parser(sub)
    add_decode_parser(sub)
    add_calibrate_parser(sub)
