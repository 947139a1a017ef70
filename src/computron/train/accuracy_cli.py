"""The ``computron bench plan-accuracy`` command: its arguments, their checks, and its output.

What flows through: the parsed arguments are checked before anything is measured (configurations,
the models and partitions they name, the planner's GPU type, the profile, the ranks against the
GPUs here), then ``accuracy.run`` (or ``accuracy.rescore`` of a stored result) gives the result
dict, written as OUT.json, drawn as OUT.png (predicted against measured) and summarised on stdout:
the errors (per GPU count too), the planner's pick against each group's fastest (``pick.py``) and
the links against the planner's assumption (``links.py``) and the tensor-parallel per-collective
cost measured and used (``tpcoll.py``). Where the profiles have ``step_s`` the rows and the summary
also give the predictions with ``Assumptions.paired_steps`` on (``paired_s``, drawn beside the
default's), the rest staying on the default.
"""

from __future__ import annotations

import json
import sys

from . import accuracy
from .accuracy import DEFAULT_CONFIGS, FORMAT, Config, rescore, run


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 6), dpi=110)
    x, y = [r["measured_s"] for r in rows], [r["predicted_s"] for r in rows]
    ax.scatter(x, y, c="C0", label="predicted")
    if paired := [r for r in rows if "paired_s" in r]:
        ax.scatter([r["measured_s"] for r in paired], [r["paired_s"] for r in paired], c="C1", marker="x",
                   label="predicted, forward and backward as a step (paired_s)")
        y = y + [r["paired_s"] for r in paired]
    for r in rows:
        ax.annotate(r["config"], (r["measured_s"], r["predicted_s"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    lo, hi = min(x + y) * 0.8, max(x + y) * 1.2
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.85", label="±10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured iteration time (s)")
    ax.set_ylabel("predicted iteration time (s)")
    s = result["summary"]
    ax.set_title(f"plan estimate vs measured on {result['gpu']}: MAE {s['time_mean_abs_error']:.1%}, "
                 f"rank corr {s['spearman']:.2f}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_bench_parser(bsub) -> None:
    p = bsub.add_parser("plan-accuracy", help="training layouts measured here against plan estimate",
                        description=accuracy.__doc__.splitlines()[0])
    p.add_argument("--config", action="append", default=None, metavar=FORMAT,
                   help="a configuration (repeat it; default: ten GPT-shaped ones, 125M to 1.5B, one GPU each); "
                        "a layout of several ranks runs on as many local devices")
    p.add_argument("--gpu", default=None, help="the planner's GPU type of this device (default: detected)")
    p.add_argument("--profile", default=None,
                   help="a 'plan profile' JSON of this GPU, 'auto' (profile the trainer's layer here first, for every "
                        "model and sequence length), or 'roofline' (no profile); default: auto on a GPU, else "
                        "roofline. Where the profile has step_s (forward and backward timed back to back), each row also gives "
                        "paired_s: the prediction with Assumptions.paired_steps on")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"), help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="bench/results/plan_accuracy", help="writes OUT.json and OUT.png")
    p.add_argument("--rescore", metavar="RESULT.json", default=None,
                   help="predict a stored result's measurements again with the planner as it is now (no device)")
    p.add_argument("--profiles", metavar="DIR", default=None, help="with --rescore: the directory of its profiles")
    p.add_argument("--no-pick", dest="pick", action="store_false",
                   help="skip the planner's pick (plan search per group of configurations, measured against the "
                        "group's fastest)")
    p.add_argument("--no-links", dest="links", action="store_false",
                   help="skip measuring all-reduce and send/recv bandwidth against the planner's assumption")
    p.add_argument("--link-sizes", type=_mib_list, default=None, metavar="MIB,MIB,...",
                   help="message sizes of the link measurement in MiB (default: 1,4,16,64,256 on a GPU, "
                        "0.0625,0.25,1 on the CPU)")
    p.add_argument("--no-tp-collective", dest="tp_collective", action="store_false",
                   help="skip measuring the per-collective cost of tensor parallelism over 2 (and 4) ranks; the "
                        "predictions take the fitted 220 us instead")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="train every layout with CUDA graphs, pipelines stage by stage (computron train "
                        "--cuda-graphs), and predict them so")
    p.set_defaults(func=cmd)


def _mib_list(text: str) -> tuple[int, ...]:
    import argparse

    try:
        sizes = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) * 2**20 < 4:
        raise argparse.ArgumentTypeError(f"expected sizes in MiB of at least 4 bytes joined by commas, got {text!r}")
    return tuple(int(x * 2**20) for x in sizes)


def cmd(args) -> int:
    from pathlib import Path

    if args.rescore:
        try:
            result = rescore(json.loads(Path(args.rescore).read_text()), args.profiles)
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            print(f"error: {args.rescore} is not a readable plan-accuracy result ({type(e).__name__}: {e})",
                  file=sys.stderr)
            return 2
        except ValueError as e:  # a profile it names is missing or of another shape
            print(f"error: {e}" + ("" if args.profiles else "; pass the directory of its profiles with --profiles"),
                  file=sys.stderr)
            return 2
        return _write(result, args.out)
    from ..models import resolve_model
    from ..parallel.dims import ParallelDims
    from ..planner.hardware import gpu_type

    try:
        configs = [Config.parse(c) for c in (args.config or DEFAULT_CONFIGS)]
        for i, c in enumerate(configs):  # refused here, before any process starts for it
            m = resolve_model(c.model, dtype="float32")[0]
            try:
                ParallelDims(tp=c.tp, pp=c.pp, dp=c.dp).validate_for(
                    num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.kv_heads)
                if c.pp * c.v > m.num_layers:
                    raise ValueError(f"pp={c.pp} x v={c.v} model chunks exceed the {m.num_layers} layers")
            except ValueError as e:
                raise ValueError(f"{c.label}: {e}") from None
            configs[i] = c.canonical(m.num_layers)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gpu = args.gpu
    if gpu is None:
        import torch

        from ..planner.profile import planner_gpu_name

        if not args.device.startswith("cuda"):
            print("error: name the planner's GPU type to predict with --gpu on a CPU", file=sys.stderr)
            return 2
        props = torch.cuda.get_device_properties(torch.device(args.device))
        gpu = planner_gpu_name(props.name, props.total_memory)
    try:
        gpu_type(gpu)
    except ValueError as e:
        print(f"error: {e}; name it with --gpu", file=sys.stderr)
        return 2
    if args.cuda_graphs and not args.device.startswith("cuda"):
        print("error: --cuda-graphs needs a CUDA device", file=sys.stderr)
        return 2
    if args.device.startswith("cuda"):
        import torch

        have = torch.cuda.device_count()
        if too_big := [c.label for c in configs if c.world > have]:
            print(f"error: {'; '.join(too_big)}: more ranks than the {have} GPU(s) here", file=sys.stderr)
            return 2
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    profile = args.profile or ("auto" if args.device.startswith("cuda") else "roofline")
    if profile not in ("auto", "roofline"):  # read it now, not after the measurements it would waste
        from ..planner.measured import load_profile

        try:
            load_profile(profile, gpu)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        result = run(configs, gpu, args.device, dtype, None if profile == "roofline" else profile, args.warmup,
                     args.steps, out=args.out, pick=args.pick, links=args.links, link_sizes=args.link_sizes,
                     graphs=args.cuda_graphs, tp_collective=args.tp_collective)
    except RuntimeError as e:  # not one configuration ran
        print(f"error: {e}", file=sys.stderr)
        return 1
    return _write(result, args.out)


def _write(result: dict, out: str) -> int:
    from pathlib import Path

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out + ".png")
    s = result["summary"]
    print(f"{s['configs']} configurations: time error {s['time_mean_abs_error']:.1%} mean, {s['time_worst_abs_error']:.1%} "
          f"worst; memory error {s['memory_mean_abs_error']:.1%} mean; rank correlation {s['spearman']:.2f}; best "
          f"{s['best']} at {s['best_tflops_per_gpu']:.1f} TFLOP/s = {s['best_fraction_of_matmul']:.0%} of the measured "
          f"{s['matmul_tflops']:.0f} TFLOP/s matrix rate; wrote {out}.json, {out}.png")
    if "paired_time_mean_abs_error" in s:
        print(f"  with each layer's forward and backward timed as a step (paired_steps, paired_s): time error "
              f"{s['paired_time_mean_abs_error']:.1%} mean, {s['paired_time_worst_abs_error']:.1%} worst; rank "
              f"correlation {s['paired_spearman']:.2f}")
    for n, g in s.get("by_gpus", {}).items():
        print(f"  on {n} GPU(s): {g['configs']} configurations, time error {g['time_mean_abs_error']:.1%} mean, "
              f"{g['time_worst_abs_error']:.1%} worst; memory error {g['memory_mean_abs_error']:.1%} mean; rank "
              f"correlation {g['spearman']:.2f}; best {g['best']} at {g['best_tflops_per_gpu']:.1f} TFLOP/s"
              + (f"; paired_s time error {g['paired_time_mean_abs_error']:.1%} mean, "
                 f"{g['paired_time_worst_abs_error']:.1%} worst" if "paired_time_mean_abs_error" in g else ""))
    if "pick" in result:
        from .pick import print_report

        print_report(result["pick"])
    if result.get("links"):
        from .links import print_report

        print_report(result["links"])
    if "tp_collective" in result:
        from .tpcoll import print_report

        print_report(result["tp_collective"])
    for label, why in result.get("failed", {}).items():
        print(f"error: {label}: {why}", file=sys.stderr)
    return 1 if result.get("failed") else 0
