"""``computron plan``: search, estimate, pareto and profile sub-commands.

Wiring: the top-level CLI calls :func:`add_parser` with its sub-parsers object; the ``plan``
parser sets ``func`` to a callable taking the parsed namespace and returning an exit code.
:func:`main` builds a standalone parser (``prog="computron plan"``) for tests and
``python -m computron.planner.cli``. Exit codes: 0 done, 1 no feasible plan, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys

from computron.parallel.dims import ParallelDims

from .costs import Assumptions
from .errors import PlannerError
from .estimate import METHODS, CostModel, PlanConfig, PlanContext
from .hardware import Cluster, load_cluster
from .layout import check_dims, parse_placement, placement_text, stage_envs
from .measured import load_profile
from .model import PRESETS, TransformerShape, load_model

FORMATTER = argparse.ArgumentDefaultsHelpFormatter


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _stages(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        vals = ()
    if not vals or any(v not in (0, 1, 2, 3) for v in vals):
        raise argparse.ArgumentTypeError(f"expected ZeRO stages among 0,1,2,3, got {text!r}")
    return vals


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=f"preset name ({', '.join(PRESETS)}) or a YAML file")
    p.add_argument("--seq-len", type=int, help="override the model's sequence length")
    p.add_argument("--global-batch", type=int, help="override the global batch (sequences per iteration)")


def _cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", help="measured layer profile (from 'plan profile') used instead of the roofline")
    p.add_argument("--profile-gpu", help="GPU type the profile stands for (default: the one it recorded)")
    p.add_argument("--bytes-per-param", type=int, choices=(16, 18, 20), default=16,
                   help="weights+grads+Adam bytes per parameter (16 fp16 grads, 18 fp32 grads, 20 both)")
    p.add_argument("--memory-margin", type=float, default=0.10, help="fraction of GPU memory kept free")
    p.add_argument("--zero1", dest="zero", action="store_const", const=(1,),
                   help="alias of --zero 1 (optimizer state sharded over the data-parallel ranks)")
    p.add_argument("--fp8", action="store_true",
                   help="the layers' weight GEMMs in fp8 (Transformer Engine's recipe; GPUs with fp8 only)")
    p.add_argument("--tp-overlap", action="store_true",
                   help="TP all-gathers/reduce-scatters overlapped with the GEMMs (needs sequence parallelism)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="the runtime replays each micro-batch as CUDA graphs, a pipeline's stage by stage "
                        "(computron train --cuda-graphs): its layers at the profile's graph_s where it has them, "
                        "its tensor-parallel all-reduces at their ring time, with no host cost; a stage's "
                        "memory holds a graph pool per micro-batch in flight")


def _search_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--partition", default=",".join(METHODS), help="partition methods to try (balanced,greedy,exact)")
    p.add_argument("--virtual-stages", type=_ints, default=(1,),
                   help="model chunks per stage to try, e.g. 1,2,4 (default 1: plain 1F1B only)")
    p.add_argument("--recompute", choices=("auto", "none", "selective", "full"), default="auto",
                   help="activation recomputation: auto = the first of none, selective, full with which a plan fits")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="plans with tp > 1 keep norms and dropouts replicated (default: sequence parallelism)")
    p.add_argument("--zero", type=_stages, default=None,
                   help="ZeRO stages to try in turn, the first with which a plan fits (default 1,2,3; 0 = none)")
    p.add_argument("--cp", type=_ints, help="context-parallel degrees (default: 1, and 2, 4, ... while each rank "
                                            "keeps >= 4096 tokens of a sequence, for models with fused attention)")
    p.add_argument("--tp", type=_ints, help="restrict tensor-parallel degrees, e.g. 1,2,4")
    p.add_argument("--pp", type=_ints, help="restrict pipeline degrees")
    p.add_argument("--mbs", type=_ints, help="restrict micro-batch sizes")
    p.add_argument("--max-mbs", type=int, default=64, help="largest micro-batch size tried")
    p.add_argument("--max-orderings", type=int, default=20000,
                   help="distinct node orderings tried per composition; beyond it nodes of a type move in blocks")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``plan`` (with search/estimate/pareto/profile) to a top-level sub-parsers object."""
    plan = subparsers.add_parser("plan", help="plan parallel training layouts on (heterogeneous) GPU clusters",
                                 description="Find the best data/tensor/pipeline layout for training a Transformer.")
    _fill(plan)
    return plan


def _fill(plan: argparse.ArgumentParser) -> None:
    sub = plan.add_subparsers(dest="plan_command", metavar="{search,estimate,pareto,profile,launch}")
    plan.set_defaults(func=_no_command(plan))

    s = sub.add_parser("search", help="rank the best plans", formatter_class=FORMATTER)
    _model_args(s)
    s.add_argument("--cluster", required=True, help="YAML file or compact spec GPU:GPUSxNODES,... e.g. a100-80gb:8x4,a10:4x12")
    s.add_argument("--objective", choices=("time", "cost", "throughput"), default="time",
                   help="time: least iteration time; cost: least USD/iteration under --time-limit; "
                        "throughput: most samples/s under --cost-limit")
    s.add_argument("--top", type=int, default=10, help="plans to list")
    s.add_argument("--time-limit", type=float, help="seconds per iteration (objective cost)")
    s.add_argument("--cost-limit", type=float, help="USD per hour of the nodes used (objective throughput)")
    s.add_argument("--all-nodes", action="store_true", help="only plans that use every node of the cluster")
    _search_args(s)
    _cost_args(s)
    s.add_argument("--csv", help="write the ranked plans as CSV")
    s.add_argument("--json", help="write the ranked plans as JSON")
    s.set_defaults(func=_guarded(cmd_search))

    e = sub.add_parser("estimate", help="time, breakdown and memory of one plan", formatter_class=FORMATTER)
    _model_args(e)
    e.add_argument("--cluster", required=True, help="YAML file or compact spec")
    for k in ("tp", "pp", "dp", "mbs"):
        e.add_argument(f"--{k}", type=int, required=True)
    e.add_argument("--cp", type=int, default=1, help="context-parallel degree (ring attention)")
    e.add_argument("--zero", type=lambda x: _stages(x)[0], choices=(0, 1, 2, 3), default=0,
                   help="ZeRO stage: 1 optimizer state, 2 + gradients, 3 + weights (FSDP) sharded")
    e.add_argument("--virtual-stages", type=int, default=1, help="model chunks per stage (interleaved 1F1B)")
    e.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                   help="activation recomputation: selective recomputes the attention core only")
    e.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism over the TP ranks")
    e.add_argument("--dp-overlap", action="store_true", help="gradient all-reduce overlapped with the last backward")
    e.add_argument("--partition", default="exact", help="balanced, greedy, exact or explicit counts like 12,12,12,12")
    e.add_argument("--placement", help="node order, e.g. a100-80gb*2,v100*2 (default: cluster order, first nodes)")
    _cost_args(e)
    e.add_argument("--json", help="write the result as JSON")
    e.add_argument("--csv", help="write the result as a one-row CSV")
    e.set_defaults(func=_guarded(cmd_estimate))

    p = sub.add_parser("pareto", help="cost against throughput over cluster compositions", formatter_class=FORMATTER)
    _model_args(p)
    p.add_argument("--node-types", required=True, help="GPU[:GPUS[xMAXNODES]],... e.g. a100-80gb,v100:8x4")
    p.add_argument("--max-nodes", type=int, required=True, help="most nodes in a composition")
    _search_args(p)
    _cost_args(p)
    p.add_argument("--png", default="plan_pareto.png", help="chart output")
    p.add_argument("--csv", help="write all points as CSV")
    p.add_argument("--json", help="write all points as JSON")
    p.set_defaults(func=_guarded(cmd_pareto))

    f = sub.add_parser("profile", help="measure per-layer time and memory on the local GPU", formatter_class=FORMATTER)
    _model_args(f)
    f.add_argument("--tp", type=_ints, default=(1,), help="tensor-parallel shards to measure")
    f.add_argument("--mbs", type=_ints, default=(1, 2, 4), help="micro-batch sizes to measure")
    f.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    f.add_argument("--gpu-type", help="planner GPU type to record (default: detected from the device name)")
    f.add_argument("--warmup", type=int, default=3)
    f.add_argument("--repeats", type=int, default=10)
    f.add_argument("--out", default="plan_profile.json", help="profile file to write (JSON)")
    f.set_defaults(func=_guarded(cmd_profile))

    from computron.train import launch  # runs a plan (torch only once it trains)

    launch.add_parser(sub)


def _no_command(parser):
    def run(args) -> int:
        parser.print_help()
        return 2
    return run


# ------------------------------------------------------------------ helpers
def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 220, soft_wrap=False)


def _model(args) -> TransformerShape:
    return load_model(args.model, seq_len=args.seq_len, global_batch=args.global_batch)


def _cost_model(args, m: TransformerShape) -> CostModel:
    a = Assumptions(bytes_per_param=args.bytes_per_param, memory_margin=args.memory_margin,
                    graphed_steps=args.cuda_graphs)
    prof = load_profile(args.profile, args.profile_gpu) if args.profile else None
    return CostModel(m, a, prof)


def _search_options(args, **extra):
    from .search import SearchOptions

    methods = tuple(x.strip() for x in args.partition.split(",") if x.strip())
    return SearchOptions(methods=methods, virtual_stages=args.virtual_stages, recompute=args.recompute,
                         sequence_parallel=args.sequence_parallel, tp=args.tp, pp=args.pp,
                         mbs=args.mbs, max_mbs=args.max_mbs, max_orderings=args.max_orderings, zero=args.zero,
                         cp=args.cp, fp8=args.fp8, tp_overlap=args.tp_overlap, **extra)


class _Progress:
    """A progress bar on stderr for searches that run longer than a second, only when stderr is a
    terminal: the search's lower bound left against the best plan found (it ends at 100%)."""

    DELAY_S = 1.0

    def __init__(self):
        self.bar = self.task = None
        self.t0 = 0.0

    def __enter__(self):
        import time

        self.t0 = time.perf_counter()
        return self if sys.stderr.isatty() else None

    def __call__(self, bound: float, best: float, stats: dict) -> None:
        import time

        if self.bar is None:
            if time.perf_counter() - self.t0 < self.DELAY_S:
                return
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("searching"), BarColumn(), TextColumn("{task.description}"),
                                TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("", total=1.0)
            self.bar.start()
        done = bound / best if best < float("inf") and best > 0 else 0.0
        self.bar.update(self.task, completed=min(done, 1.0),
                        description=f"bound {bound:.3f} s / best {best:.3f} s, {stats['simulated']} simulated")

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def _default_placement(cluster: Cluster, gpus: int):
    """The first nodes of the cluster, in listed order, that hold exactly ``gpus`` GPUs."""
    out, n = [], 0
    for nt in cluster.node_types:
        for _ in range(nt.count):
            if n >= gpus:
                break
            out.append(nt)
            n += nt.gpus_per_node
    if n != gpus:
        raise PlannerError(f"tp*pp*dp = {gpus} GPUs does not match whole nodes of the cluster "
                           f"({cluster}, {cluster.total_gpus} GPUs); give --placement or change the degrees")
    return tuple(out)


# ------------------------------------------------------------------ commands
def cmd_search(args) -> int:
    from . import report
    from .search import search

    m = _model(args)
    cluster = load_cluster(args.cluster)
    cm = _cost_model(args, m)
    opts = _search_options(args, objective=args.objective, top=args.top, time_limit=args.time_limit,
                           cost_limit=args.cost_limit, all_nodes=args.all_nodes)
    with _Progress() as progress:
        res = search(m, cluster, opts, cm, progress=progress)
    con = _console()
    st = res.stats
    blocks = f", nodes placed in blocks of {st['block_size']}" if st["block_size"] > 1 else ""
    title = (f"{m.name} on {cluster}: best {len(res.plans)} by {args.objective} "
             f"({st['placements']} placements, {st['candidates']} partitions bounded, {st['simulated']} simulated, "
             f"{st['seconds']:.2f} s{blocks})")
    rows = [report.plan_row(r, i) for i, r in enumerate(res.plans, 1)]
    if args.csv:
        report.write_csv(rows, args.csv)
    if args.json:
        report.write_json({"model": m.to_dict(), "cluster": str(cluster), "objective": args.objective,
                           "stats": st, "plans": [dict(row, detail=r.to_dict()) for row, r in zip(rows, res.plans)]},
                          args.json)
    if not res.plans:
        print(f"no feasible plan for {m.name} on {cluster} (memory, limits or batch divisibility rule out all)",
              file=sys.stderr)
        return 1
    con.print(report.plans_table(res.plans, title))
    best = res.plans[0]
    con.print(f"best: ParallelDims({best.dims}) mbs={best.config.mbs} placement {placement_text(best.placement)} "
              f"layers {list(best.partition)}: {best.iteration_s:.3f} s/iteration, {best.tokens_per_s:,.0f} tokens/s")
    return 0


def _explicit_counts(text: str):
    if "," in text or text.strip().isdigit():
        try:
            return tuple(int(x) for x in text.split(","))
        except ValueError:
            raise PlannerError(f"malformed --partition {text!r}: give a method ({', '.join(METHODS)}) or layer counts") from None
    return None


def cmd_estimate(args) -> int:
    from . import report

    m = _model(args)
    cluster = load_cluster(args.cluster)
    cm = _cost_model(args, m)
    try:
        dims = ParallelDims(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp)
    except ValueError as e:
        raise PlannerError(str(e)) from None
    check_dims(m, dims, [])  # the model's constraints first, then the nodes'
    placement = parse_placement(args.placement, cluster) if args.placement else _default_placement(cluster, dims.world_size)
    check_dims(m, dims, sorted({n.gpus_per_node for n in placement}))
    zero = args.zero[0] if isinstance(args.zero, tuple) else args.zero  # --zero1 gives (1,)
    cfg = PlanConfig(dims, args.mbs, args.virtual_stages, args.recompute == "full", zero, args.dp_overlap,
                     args.sequence_parallel, args.recompute == "selective", args.fp8, args.tp_overlap)
    ctx = PlanContext(cm, stage_envs(placement, dims, cm.a), cfg)
    counts = _explicit_counts(args.partition)
    if counts is not None:
        counts, method = ctx.check_counts(counts), "given"
    else:
        method = args.partition
        counts = ctx.partition(method) or ctx.partition(method, respect_memory=False)
        if counts is None:
            raise PlannerError(f"partition method {method!r} found no partition of {m.layers} layers over pp={dims.pp}")
    r = ctx.result(counts, method, placement)
    con = _console()
    con.print(f"{m.name}: ParallelDims({dims}) mbs={cfg.mbs} micro-batches={r.micro_batches} v={cfg.v} "
              f"recompute={args.recompute} zero={cfg.zero} sp={'on' if cfg.sp else 'off'} fp8={'on' if cfg.fp8 else 'off'} "
              f"tp-overlap={'on' if cfg.tp_overlap else 'off'} on {placement_text(placement)} layers {list(counts)}")
    con.print(report.breakdown_table(r))
    con.print(report.stages_table(r))
    con.print(f"{r.samples_per_s:.2f} samples/s, {r.tokens_per_s:,.0f} tokens/s, {r.model_tflops_per_gpu:.1f} model "
              f"TFLOP/s per GPU (MFU {r.mfu:.1%}), ${r.price_per_hour:.2f}/h, ${r.cost_per_iteration:.4f}/iteration, "
              f"${r.usd_per_mtok:.4f} per million tokens; costs from {'+'.join(r.sources)}")
    if args.json:
        report.write_json({"model": m.to_dict(), "cluster": str(cluster), **report.plan_row(r), "detail": r.to_dict()}, args.json)
    if args.csv:
        report.write_csv([report.plan_row(r)], args.csv)
    if not r.feasible:
        print("does NOT fit in memory: see the stages table", file=sys.stderr)
        return 1
    return 0


def cmd_pareto(args) -> int:
    from . import report
    from .pareto import parse_node_types, pareto_front, plot, point_row, sweep

    m = _model(args)
    types, caps = parse_node_types(args.node_types)
    cm = _cost_model(args, m)
    points = sweep(m, types, caps, args.max_nodes, _search_options(args), cm)
    front = pareto_front(points)
    on = {id(p) for p in front}
    rows = [point_row(p, id(p) in on) for p in sorted(points, key=lambda p: (-p.tokens_per_s, p.price_per_hour))]
    plot(points, front, args.png, f"{m.name}: cost vs throughput ({args.node_types}, <= {args.max_nodes} nodes)")
    if args.csv:
        report.write_csv(rows, args.csv)
    if args.json:
        report.write_json({"model": m.to_dict(), "node_types": args.node_types, "max_nodes": args.max_nodes,
                           "points": rows}, args.json)
    from rich.table import Table

    t = Table(title=f"Pareto front: {len(front)} of {len(points)} compositions ({args.png})")
    for col in ("composition", "GPUs", "$/h", "tokens/s", "$/M tokens", "iter s", "layout", "placement"):
        t.add_column(col)
    for p in front:
        r = point_row(p, True)
        t.add_row(r["composition"], str(r["gpus"]), f"{r['price_per_hour']:.2f}", f"{r['tokens_per_s']:,.0f}",
                  f"{r['usd_per_mtok']:.4f}", f"{r['iteration_s']:.3f}", r["layout"], placement_text(p.plan.placement))
    _console().print(t)
    return 0 if front else 1


def cmd_profile(args) -> int:
    from . import report
    from .profile import run_profile

    m = _model(args)
    if bad := [t for t in args.tp if m.heads % t or m.ffn % t]:
        raise PlannerError(f"tp={bad[0]} does not divide {m.name}'s {m.heads} heads and {m.ffn} FFN columns "
                           "into equal shards")
    data = run_profile(m, list(args.tp), list(args.mbs), args.device, args.gpu_type, args.warmup, args.repeats)
    report.write_json(data, args.out)
    print(f"wrote {args.out} ({len(data['entries'])} entries, GPU type {data['gpu']!r} on {data['device_name']})")
    return 0


# ------------------------------------------------------------------ entry points
def _guarded(func):
    def run(args) -> int:
        try:
            return func(args)
        except PlannerError as e:
            print(f"computron plan: error: {e}", file=sys.stderr)
            return 2
    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="computron plan", description="Plan parallel training layouts.")
    _fill(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``computron plan ...`` with ``argv`` (without the leading ``plan``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return dispatch(args)


def dispatch(args) -> int:
    """Run the command a parsed namespace names (its ``func`` already maps PlannerError to exit code 2)."""
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
