"""``computron sim``: what a policy, a budget and a workload would do, before running them.

A workload (a JSONL trace, or arrivals generated per model: Gamma with a rate and a CV, Poisson
or on/off bursts, with a power-law skew over the models) runs through the real engine core and
scheduler on a simulated executor and a virtual clock, with a calibration (built-in ``cpu`` or
``h200-rough``, or a JSON file). Prints per-model latency and time to first token and writes the
records and summary as JSON. Imports no torch.
"""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    p = sub.add_parser("sim", help="simulate a workload on the real scheduler with a calibrated cost model",
                       description=__doc__.splitlines()[0])
    p.add_argument("--models", required=True,
                   help="comma-separated presets or checkpoints, NAME_OR_DIR[=ALIAS] (aliases name copies)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="FILE.jsonl", help="arrivals from a trace (time, model, prompt_tokens, "
                                                           "output_tokens per line)")
    src.add_argument("--rate", type=float, help="requests per second over all models")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of generated arrivals (default 30)")
    p.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of inter-arrival times (gamma)")
    p.add_argument("--skew", type=float, default=0.0, help="power-law exponent of the per-model rates (0: even)")
    p.add_argument("--process", choices=("gamma", "poisson", "bursts"), default="gamma")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--output", type=int, default=128, help="output tokens per request (default 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibration", default="cpu", help="cpu, h200-rough, or a calibration JSON file")
    p.add_argument("--policy", choices=("default", "computron"), default="default")
    p.add_argument("--budget", metavar="SIZE", help="device memory budget, e.g. 40GiB (default: the calibration's)")
    p.add_argument("--max-loaded", type=int, default=1, help="computron policy: models resident at once")
    p.add_argument("--out", default=None, help="JSON output (default: bench/results/sim_<policy>.json)")
    p.set_defaults(func=main)


def main(args) -> int:
    from ..bench.common import write_json
    from ..config import EngineConfig, ModelSpec
    from ..workload import Trace, make_workload
    from .costs import calibration
    from .run import simulate

    try:
        specs = [ModelSpec.parse(m.strip()) for m in args.models.split(",") if m.strip()]
        if not specs:
            raise ValueError("--models names no model")
        cal = calibration(args.calibration)
        cfg = EngineConfig(device="cpu", gpu_memory_budget=args.budget, policy=args.policy,
                           max_loaded=args.max_loaded)
        names = [s.name for s in specs]
        if args.trace:
            trace = Trace.read_jsonl(args.trace)
            unknown = sorted(set(trace.models) - set(names))
            if unknown:
                raise ValueError(f"the trace names model(s) {', '.join(unknown)} that --models does not "
                                 f"({', '.join(names)})")
        else:
            trace = make_workload(names, args.rate, args.duration, cv=args.cv, skew=args.skew, prompt=args.prompt,
                                  output=args.output, seed=args.seed, process=args.process)
        result = simulate(trace, specs, cal, cfg)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"computron sim: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    summary = result.summary()
    out = args.out or f"bench/results/sim_{args.policy}.json"
    write_json(out, {"settings": {k: v for k, v in vars(args).items() if k != "func"},
                     "calibration": cal.to_dict(), "summary": summary,
                     "records": [r.__dict__ for r in result.records]})
    _print(summary, args)
    print(f"wrote {out}")
    return 0


def _print(summary: dict, args) -> None:
    from ..bench.common import print_table

    rows = []
    for name, s in [*summary["models"].items(), ("all", summary["all"])]:
        lat, ttft = s["latency"], s["ttft"]
        rows.append([name, s["requests"], s["completed"], s["failed"], lat["mean"], lat["p50"], lat["p99"],
                     ttft["p50"], ttft["p99"]])
    print_table(f"sim: policy {args.policy}, calibration {args.calibration} (seconds)",
                ["model", "requests", "done", "failed", "latency mean", "p50", "p99", "TTFT p50", "TTFT p99"], rows)
    st = summary["stats"]
    print(f"simulated {summary['end_time']:.1f} s in {summary['steps']} steps; swap-ins {st.get('swap_ins', 0)}, "
          f"evictions {st.get('evictions', 0)}, preemptions {st.get('preemptions', 0)}")
