"""The workload and SLO flags that ``computron loadgen`` and ``computron sim`` share, and the trace
they describe. One spelling of a workload for the measured and the simulated run."""

from __future__ import annotations

from .arrivals import STARTS
from .make import PROCESSES, make_workload
from .trace import Trace


def add_workload_args(p, source_required: bool = True) -> None:
    src = p.add_mutually_exclusive_group(required=source_required)
    src.add_argument("--trace", metavar="FILE.jsonl", help="arrivals from a trace (time, model, prompt_tokens, "
                                                           "output_tokens per line)")
    src.add_argument("--rate", type=float, help="requests per second over all models")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of generated arrivals (default 30)")
    p.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of inter-arrival times (gamma)")
    p.add_argument("--skew", type=float, default=0.0, help="power-law exponent of the per-model rates (0: even)")
    p.add_argument("--rates", default=None, help="explicit per-model rates, comma-separated, in --models order "
                                                 "(instead of --rate and --skew)")
    p.add_argument("--process", choices=PROCESSES, default="gamma")
    p.add_argument("--start", choices=STARTS, default="stationary",
                   help="gamma: each model's arrivals seen from a random instant (stationary, default), or from "
                        "an arrival at 0 (arrival: bursty streams then all open with a burst; how traces were made "
                        "before 2026-11-29)")
    p.add_argument("--prompt", default="128", help="prompt tokens per request: N or LO:HI (default 128)")
    p.add_argument("--output", default="128", help="output tokens per request: N or LO:HI (default 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ms", type=float, default=None,
                   help="base SLO in milliseconds of latency (default: each model's solo latency)")
    p.add_argument("--slo-scale", type=float, default=5.0,
                   help="the multiple of the base SLO the summary reports attainment at (default 5)")
    p.add_argument("--plots", metavar="DIR", default=None, help="write latency_cdf.png and slo_attainment.png here")


def _length(text: str, flag: str):
    try:
        if ":" in str(text):
            lo, hi = (int(x) for x in str(text).split(":"))
            return (lo, hi)
        return int(text)
    except ValueError:
        raise ValueError(f"{flag} must be N or LO:HI, got {text!r}") from None


def workload_from_args(args, names: list[str]) -> Trace:
    """The trace the flags describe; a trace file must name only models in ``names``."""
    if args.trace:
        trace = Trace.read_jsonl(args.trace)
        unknown = sorted(set(trace.models) - set(names))
        if unknown:
            raise ValueError(f"the trace names model(s) {', '.join(unknown)} that --models does not "
                             f"({', '.join(names)})")
        return trace
    rates = None
    if getattr(args, "rates", None):
        try:
            rates = [float(x) for x in args.rates.split(",")]
        except ValueError:
            raise ValueError(f"--rates must be numbers separated by commas, got {args.rates!r}") from None
        if len(rates) != len(names):
            raise ValueError(f"--rates gives {len(rates)} rates for {len(names)} models")
    elif args.rate is None:
        raise ValueError("give --trace, --rate or --rates")
    return make_workload(names, None if rates else args.rate, args.duration, cv=args.cv, skew=args.skew,
                         rates=rates, prompt=_length(args.prompt, "--prompt"), output=_length(args.output, "--output"),
                         seed=args.seed, process=args.process, start=args.start)


def slo_report(records, base, args, title: str) -> dict:
    """Attainment curves (and the scale the summary reports), with the plots written if asked."""
    from .report import SCALES, attainment, plot_attainment, plot_cdf

    scales = sorted(set(SCALES) | {args.slo_scale})
    slo = attainment(records, base, scales)
    slo["report_scale"] = args.slo_scale
    slo["base_s"] = base
    if args.plots:
        from pathlib import Path

        d = Path(args.plots)
        plot_cdf(records, d / "latency_cdf.png", f"{title}: latency")
        plot_attainment(slo, d / "slo_attainment.png", f"{title}: SLO attainment")
    return slo
