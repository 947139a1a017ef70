"""``computron sim``: what a policy, a budget and a workload would do, before running them.

A workload (a JSONL trace, arrivals generated per model: Gamma with a rate and a CV, Poisson or
on/off bursts, with a power-law skew or explicit rates, or a preset of the original Computron
simulation) runs through the real engine core and scheduler on a simulated executor and a virtual
clock, with a calibration (built-in ``cpu`` or ``h200-rough``, or a file from ``computron bench
calibrate``). Prints per-model latency, time to first token, time per output token and SLO
attainment, writes the records and summary as JSON and, with ``--plots``, the latency CDF and the
attainment curve. ``--sweep rate|cv|budget --values ...`` runs every policy (or ``--policies``) at each value and
plots attainment against it. Imports no torch.

Presets (``--preset``): N copies of one model (``--models``, default opt-13b), the budget holding
R of them (and half a model's bytes of KV cache); the ``computron`` policy keeps R resident:

    3m-1-1-1, 3m-10-1-1, 3m-10-10-1                  3 models, 2 resident, rates as named (req/s)
    6m-1x6, 6m-10-10-1-1-1-1, 6m-10x4-1-1           6 models, 4 resident
"""

from __future__ import annotations

import dataclasses
import sys

POLICIES = ("default", "preempt", "slo", "computron")
KEEP_KV = "preempt-keep-kv"  # the preempt policy with preempt_keeps_kv on: stopped requests keep their caches
PRESETS = {  # name: (models resident at once, per-model rates)
    "3m-1-1-1": (2, (1, 1, 1)), "3m-10-1-1": (2, (10, 1, 1)), "3m-10-10-1": (2, (10, 10, 1)),
    "6m-1x6": (4, (1,) * 6), "6m-10-10-1-1-1-1": (4, (10, 10, 1, 1, 1, 1)), "6m-10x4-1-1": (4, (10,) * 4 + (1, 1)),
}


def add_parser(sub) -> None:
    from ..workload.args import add_workload_args

    p = sub.add_parser("sim", help="simulate a workload on the real scheduler with a calibrated cost model",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None,
                   help="comma-separated presets or checkpoints, NAME_OR_DIR[=ALIAS] (aliases name copies); "
                        "with --preset, the one model copied (default opt-13b)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a workload of the original Computron simulation (rates, copies, models resident)")
    add_workload_args(p, source_required=False)
    p.add_argument("--calibration", default="cpu", help="cpu, h200-rough, or a calibration JSON file")
    p.add_argument("--policy", choices=POLICIES + (KEEP_KV,), default="default",
                   help=f"{KEEP_KV}: the preempt policy, its stopped requests keeping their caches on the "
                        "device while they fit instead of recomputing them")
    p.add_argument("--budget", metavar="SIZE", help="device memory budget, e.g. 40GiB (default: the calibration's)")
    p.add_argument("--kv-host", metavar="SIZE", default=None,
                   help=f"slo and {KEEP_KV} policies: host memory the caches of stopped requests may move to "
                        "when their device memory is needed (default 0: off)")
    p.add_argument("--max-loaded", type=int, default=1, help="computron policy: models resident at once")
    p.add_argument("--loadgen-probes", action="store_true",
                   help="start as `computron loadgen` leaves a server before its replay: first, per model, its "
                        "warm-up and solo-latency requests, one at a time (the models they leave resident, and "
                        "the host copies the legacy executor leaves page-locked, are the trace's start)")
    p.add_argument("--stripe-devices", metavar="I,J,...", default=None,
                   help="default policy: loads also pull through these GPUs' host links (`computron serve "
                        "--stripe-devices`); the calibration's host_bandwidth caps the links together")
    p.add_argument("--models-per-step", type=int, default=1,
                   help="batches of different models one step runs together on a device (default 1)")
    p.add_argument("--concurrent-step-fraction", type=float, default=None,
                   help="what each batch sharing a device's step adds beyond the longest, as a fraction of its "
                        "time alone (default: the calibration's; 1: one after another)")
    p.add_argument("--max-wait", type=float, default=1.0, help="preempt and slo policies: seconds a request may "
                                                               "be kept waiting by other models' running requests")
    p.add_argument("--sweep", choices=("rate", "cv", "budget"), default=None,
                   help="run every policy at each of --values and plot SLO attainment against it")
    p.add_argument("--values", default=None, help="the sweep's values, comma-separated (sizes for budget)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"the policies a sweep compares (default: {','.join(POLICIES)}; {KEEP_KV} too)")
    p.add_argument("--out", default=None, help="JSON output (default: bench/results/sim_<policy|sweep>.json)")
    p.set_defaults(func=main)


def _setup(args):
    """(model specs, engine config keyword arguments) from the flags and the preset."""
    specs, kw = _models_and_budget(args)
    kw["models_per_step"] = getattr(args, "models_per_step", 1)
    stripe = getattr(args, "stripe_devices", None)
    if stripe:
        from ..config import parse_stripe_devices

        kw["stripe_devices"] = parse_stripe_devices(stripe)
    return specs, kw


def _models_and_budget(args):
    from ..config import ModelSpec, parse_bytes
    from .layout import group_bytes

    if args.preset:
        resident, rates = PRESETS[args.preset]
        base = (args.models or "opt-13b").split(",")[0].strip()
        specs = [ModelSpec.parse(f"{base}={base.split('/')[-1]}-{i}") for i in range(len(rates))]
        if args.rate is None and args.rates is None and not args.trace:
            args.rates = ",".join(str(r) for r in rates)
        budget = args.budget
        if budget is None:
            from ..models import resolve_model

            cfg, _ = resolve_model(specs[0].source, dtype=specs[0].dtype)
            budget = int((resident + 0.5) * sum(group_bytes(cfg))) + (2 << 30)  # + the workspace; exact (small models)
        return specs, dict(gpu_memory_budget=budget, max_loaded=resident, workspace_bytes=2 << 30)
    if not args.models:
        raise ValueError("give --models (or --preset)")
    specs = [ModelSpec.parse(m.strip()) for m in args.models.split(",") if m.strip()]
    if not specs:
        raise ValueError("--models names no model")
    parse_bytes(args.budget)
    return specs, dict(gpu_memory_budget=args.budget, max_loaded=args.max_loaded)


def run_once(args, specs, cfg_kw, cal, policy: str):
    """One simulation: (result, summary with SLO attainment)."""
    from ..config import EngineConfig, parse_bytes
    from ..workload.args import slo_report, workload_from_args
    from .run import Simulation

    trace = workload_from_args(args, [s.name for s in specs])
    kv_host = parse_bytes(args.kv_host) if getattr(args, "kv_host", None) else 0
    base = args.slo_ms / 1e3 if args.slo_ms else Simulation(specs, cal, EngineConfig(device="cpu", **cfg_kw)
                                                            ).solo_latency(trace)
    # the slo policy aims at the SLO the report measures: latency within slo_scale x base
    slos = {s.name: {"latency_s": args.slo_scale * (base if isinstance(base, float) else base[s.name])}
            for s in specs if isinstance(base, float) or s.name in base}
    sim = Simulation(specs, cal, EngineConfig(device="cpu", policy="preempt" if policy == KEEP_KV else policy,
                                              preempt_keeps_kv=policy == KEEP_KV, max_wait_s=args.max_wait,
                                              slos=slos, slo_scale=args.slo_scale, kv_host_bytes=kv_host,
                                              **cfg_kw))
    if getattr(args, "loadgen_probes", False):
        sim.probe(trace)
    result = sim.run(trace)
    summary = result.summary()
    plots, args.plots = args.plots, (f"{args.plots}/{policy}" if args.plots and args.sweep else args.plots)
    summary["slo"] = slo_report(result.records, base, args, f"sim, policy {policy}")
    args.plots = plots
    return result, summary


def main(args) -> int:
    from ..bench.common import write_json
    from .costs import calibration

    try:
        specs, cfg_kw = _setup(args)
        if args.trace is None and args.rate is None and args.rates is None:
            raise ValueError("give --trace, --rate, --rates or --preset")
        cal = calibration(args.calibration)
        if getattr(args, "concurrent_step_fraction", None) is not None:
            cal = dataclasses.replace(cal, concurrent_step_fraction=args.concurrent_step_fraction)
        if args.sweep:
            return _sweep(args, specs, cfg_kw, cal)
        result, summary = run_once(args, specs, cfg_kw, cal, args.policy)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"computron sim: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    out = args.out or f"bench/results/sim_{args.policy}.json"
    write_json(out, {"settings": _settings(args), "calibration": cal.to_dict(), "summary": summary,
                     "records": [dataclasses.asdict(r) for r in result.records]})
    _print(summary, args.policy, args.calibration)
    print(f"wrote {out}" + (f" and plots under {args.plots}" if args.plots else ""))
    return 0


def _settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k != "func"}


def _sweep(args, specs, cfg_kw, cal) -> int:
    from ..bench.common import print_table, write_json
    from ..config import parse_bytes
    from ..workload.report import plot_curves

    if not args.values:
        raise ValueError("--sweep needs --values, e.g. --values 1,2,4,8")
    values = [v.strip() for v in args.values.split(",") if v.strip()]
    for v in values:  # numbers for rate and cv, sizes for budget: refuse before any run
        try:
            parse_bytes(v) if args.sweep == "budget" else float(v)
        except ValueError:
            raise ValueError(f"--values for --sweep {args.sweep}: cannot read {v!r} as "
                             f"{'a size' if args.sweep == 'budget' else 'a number'}") from None
    base_rates = [float(x) for x in args.rates.split(",")] if args.rates else None
    runs, curves, rows = [], {}, []
    for policy in args.policies.split(","):
        ys = []
        for v in values:
            kw = dict(cfg_kw)
            if args.sweep == "rate":
                if base_rates:  # keep the preset's (or --rates') proportions, scaled to this total
                    total = sum(base_rates)
                    args.rates = ",".join(str(r * float(v) / total) for r in base_rates)
                else:
                    args.rate = float(v)
            elif args.sweep == "cv":
                args.cv = float(v)
            else:
                kw["gpu_memory_budget"] = v
                parse_bytes(v)
            _, summary = run_once(args, specs, kw, cal, policy)
            slo = summary["slo"]
            at = slo["all"][slo["scales"].index(args.slo_scale)]
            ys.append(at)
            runs.append({"policy": policy, args.sweep: v, "summary": summary})
            lat = summary["all"]["latency"]
            rows.append([policy, v, f"{at * 100:.1f}%", f"{lat['mean']:.3f}", f"{lat['p99']:.3f}"])
        curves[policy] = ([float(v) if args.sweep != "budget" else parse_bytes(v) / 2**30 for v in values], ys)
    print_table(f"sim sweep over {args.sweep}: SLO attainment at {args.slo_scale:g}x, latency (s)",
                ["policy", args.sweep, "attainment", "mean", "p99"], rows)
    out = args.out or f"bench/results/sim_sweep_{args.sweep}.json"
    write_json(out, {"settings": _settings(args), "calibration": cal.to_dict(), "runs": runs})
    if args.plots:
        xlabel = {"rate": "total rate (req/s)", "cv": "coefficient of variation", "budget": "budget (GiB)"}
        p = plot_curves(curves, f"{args.plots}/sweep_{args.sweep}.png", xlabel[args.sweep],
                        f"SLO attainment at {args.slo_scale:g}x against {args.sweep}")
        print(f"wrote {p}")
    print(f"wrote {out}")
    return 0


def _print(summary: dict, policy: str, cal: str) -> None:
    from ..workload.report import print_summary

    print_summary(f"sim: policy {policy}, calibration {cal}", summary, summary.get("slo"))
    st = summary["stats"]
    print(f"simulated {summary['end_time']:.1f} s in {summary['steps']} steps; swap-ins {st.get('swap_ins', 0)}, "
          f"evictions {st.get('evictions', 0)}, preemptions {st.get('preemptions', 0)}, pauses {st.get('pauses', 0)}, "
          f"caches moved to host {st.get('kv_offloaded', 0)} ({st.get('kv_moved_bytes', 0) / 2**30:.2f} GiB both ways)")
