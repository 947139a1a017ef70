"""``computron plan launch PLAN.json``: run the layout a plan chose on this machine, or write its launch files.

What flows through: a plan JSON (``plan estimate --json``, or ``plan search --json`` and its
``--index``-th plan) becomes a :class:`Layout`: the model's shape, dp/tp/pp, micro and global
batch, sequence length, the layer partition, virtual stages, recomputation, ZeRO-1, and nodes x
GPUs per node. Run here, the layout becomes a ``computron train`` command line over that many
local processes (refused, with the reason, when the plan needs more nodes or GPUs or GPU memory
than this machine has). ``--emit`` writes it instead as

- ``megatron``: a script starting Megatron-LM's ``pretrain_gpt.py`` under ``torchrun`` with the
  plan's parallelism, batch, recomputation and pipeline partition arguments;
- ``torchrun``: one ``torchrun ... computron train ...`` command per node;
- ``slurm``: an ``sbatch`` script running that command on every node through ``srun``;

and :func:`parse_emitted` reads any of them back into a ``Layout`` (the tests' round trip). Pure
Python: torch is imported only to count local GPUs and to train.
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..models.presets import PRESETS, canonical_name


class LaunchError(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    model: str  # the planner's model name
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    kv_heads: int
    dp: int
    tp: int
    pp: int
    mbs: int
    global_batch: int
    seq_len: int
    partition: tuple[int, ...]  # layers per pipeline stage
    virtual_stages: int = 1
    recompute: bool = False
    zero1: bool = False
    nodes: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def gpus_per_node(self) -> int:
        return self.world // self.nodes

    def chunk_partition(self) -> list[int]:
        """Layers of each model chunk in model order (chunk ``c * pp + s`` on stage ``s``): each
        stage's layers split as evenly as possible over its ``virtual_stages`` chunks."""
        v = self.virtual_stages
        per = [[n // v + (c < n % v) for c in range(v)] for n in self.partition]
        return [per[s][c] for c in range(v) for s in range(self.pp)]


def read_plan(path: str | Path, index: int = 1) -> Layout:
    """The layout of a plan JSON: the one plan of ``plan estimate``, or the ``index``-th (from 1) of ``plan search``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LaunchError(f"cannot read plan {path}: {e}") from None
    row = data
    if "plans" in data:
        if not 1 <= index <= len(data["plans"]):
            raise LaunchError(f"plan {path} lists {len(data['plans'])} plans; --index {index} is not one of them")
        row = data["plans"][index - 1]
    if "model" not in data:
        raise LaunchError(f"plan {path} lacks 'model': write it with 'plan estimate --json' or 'plan search --json'")
    return layout_from_plan(data["model"], row, f"plan {path}")


def layout_from_plan(model: dict, row: dict, source: str = "the plan") -> Layout:
    """The layout of one plan: ``model`` the planner's shape (``TransformerShape.to_dict``), ``row`` its
    ``report.plan_row`` with the PlanResult's ``to_dict`` as ``detail`` (what ``plan search --json``
    writes); refused, with the reason, when it uses what the training runtime does not run."""
    try:
        m, detail = model, row["detail"]
        beyond = [f"context parallelism cp={row['cp']}"] * (row.get("cp", 1) > 1) + \
            [f"ZeRO stage {row['zero']}"] * (row.get("zero", 0) >= 2) + ["fp8 matrix products"] * bool(row.get("fp8")) + \
            ["selective recomputation"] * (row.get("recompute") == "selective")
        if beyond:
            raise LaunchError(f"{source} uses {', '.join(beyond)}, which the training runtime and its launch files "
                              "do not run (ZeRO-1 at most, no cp, full or no recomputation, bf16): search with "
                              "--zero 0,1 --cp 1 --recompute auto and without --fp8")
        world = row["tp"] * row["pp"] * row["dp"]
        nodes = len(detail["placement"])
        if world % nodes:
            raise LaunchError(f"{source}: {world} GPUs over {nodes} nodes of different sizes; launch needs equal nodes")
        return Layout(model=m["name"], layers=m["layers"], hidden=m["hidden"], heads=m["heads"], ffn=m["ffn"],
                      vocab=m["vocab"], kv_heads=m.get("kv_heads") or m["heads"], dp=row["dp"], tp=row["tp"],
                      pp=row["pp"], mbs=row["mbs"], global_batch=m["global_batch"], seq_len=m["seq_len"],
                      partition=tuple(detail["partition"]), virtual_stages=row["virtual_stages"],
                      recompute=row["recompute"] == "full", zero1=bool(row["zero1"]), nodes=nodes)
    except KeyError as e:
        raise LaunchError(f"{source} lacks {e.args[0]!r}: write it with 'plan estimate --json' or 'plan search --json'") from None


def train_args(lay: Layout, model: str, steps: int, device: str | None = None) -> list[str]:
    """``computron train`` arguments (after ``train``) of one process of the layout."""
    out = ["--model", model, "--tp", str(lay.tp), "--pp", str(lay.pp), "--dp", str(lay.dp),
           "--micro-batch", str(lay.mbs), "--global-batch", str(lay.global_batch), "--seq-len", str(lay.seq_len),
           "--steps", str(steps), "--virtual-stages", str(lay.virtual_stages)]
    if lay.pp > 1:
        out += ["--partition", ",".join(map(str, lay.chunk_partition()))]
    out += ["--recompute"] * lay.recompute + ["--zero1"] * lay.zero1
    return out + (["--device", device] if device else [])


def trainable_model(lay: Layout, model: str | None) -> str:
    """The preset or checkpoint to train: ``model``, else the engine preset the plan's model names;
    refused when its shape is not the plan's."""
    from ..models import resolve_model

    name = model or lay.model
    if model is None and canonical_name(name) not in PRESETS:
        raise LaunchError(f"the plan's model {lay.model!r} is no preset here: give --model (a preset or checkpoint "
                          f"of {lay.layers} layers, hidden {lay.hidden}, {lay.heads} heads)")
    try:
        c, _ = resolve_model(name)
    except (ValueError, KeyError) as e:
        raise LaunchError(str(e.args[0] if e.args else e)) from None
    got = (c.num_layers, c.hidden_size, c.num_heads, c.ffn_size, c.vocab_size, c.kv_heads)
    want = (lay.layers, lay.hidden, lay.heads, lay.ffn, lay.vocab, lay.kv_heads)
    if got != want:
        names = ("layers", "hidden", "heads", "ffn", "vocab", "kv_heads")
        diff = ", ".join(f"{k} {g} (plan {w})" for k, g, w in zip(names, got, want) if g != w)
        raise LaunchError(f"model {name!r} is not the plan's shape: {diff}")
    return name


def check_local(lay: Layout, device: str) -> None:
    """Refuse, with the reason, a layout this machine cannot run."""
    if lay.nodes > 1:
        raise LaunchError(f"the plan spans {lay.nodes} nodes ({lay.gpus_per_node} GPUs each); run it with "
                          "--emit torchrun or --emit slurm")
    if device == "cpu":
        return
    import torch

    have = torch.cuda.device_count()
    if lay.world > have:
        raise LaunchError(f"the plan needs {lay.world} GPUs (dp={lay.dp} tp={lay.tp} pp={lay.pp}); "
                          f"this machine has {have}")


def launch_local(lay: Layout, model: str | None, steps: int, device: str, json_out: str | None) -> int:
    from ..cli import main

    check_local(lay, device)
    argv = ["train", *train_args(lay, trainable_model(lay, model), steps, device), "--nproc", str(lay.world)]
    return main(argv + (["--json", json_out] if json_out else []))


# ---- launch files ------------------------------------------------------------------------------

def megatron_args(lay: Layout) -> list[str]:
    """Megatron-LM ``pretrain_gpt.py`` arguments of the layout (its data and tokenizer arguments are the user's)."""
    a = ["--tensor-model-parallel-size", lay.tp, "--pipeline-model-parallel-size", lay.pp,
         "--micro-batch-size", lay.mbs, "--global-batch-size", lay.global_batch, "--seq-length", lay.seq_len,
         "--max-position-embeddings", lay.seq_len, "--num-layers", lay.layers, "--hidden-size", lay.hidden,
         "--num-attention-heads", lay.heads, "--ffn-hidden-size", lay.ffn, "--bf16"]
    if lay.kv_heads != lay.heads:
        a += ["--group-query-attention", "--num-query-groups", lay.kv_heads]
    part = list(lay.partition)
    if lay.pp > 1 and len(set(part)) > 1:  # Megatron takes an uneven first and last stage, the rest equal
        middle = part[1:-1]
        if len(set(middle)) > 1 or lay.virtual_stages > 1:
            raise LaunchError(f"Megatron-LM cannot express the partition {part}: only the first and last stage "
                              "may differ from the others (and not with virtual stages)")
        a += ["--decoder-first-pipeline-num-layers", part[0], "--decoder-last-pipeline-num-layers", part[-1]]
    if lay.virtual_stages > 1:
        a += ["--num-layers-per-virtual-pipeline-stage", lay.layers // (lay.pp * lay.virtual_stages)]
    if lay.recompute:
        a += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1]
    if lay.zero1:
        a += ["--use-distributed-optimizer"]
    return [str(x) for x in a]


def _torchrun(lay: Layout, node_rank: str, addr: str) -> list[str]:
    return ["torchrun", "--nnodes", str(lay.nodes), "--nproc-per-node", str(lay.gpus_per_node),
            "--node-rank", node_rank, "--master-addr", addr, "--master-port", "29500"]


def emit(lay: Layout, kind: str, model: str | None, steps: int) -> dict[str, str]:
    """File name -> text of the launch files of ``kind`` (megatron, torchrun, slurm)."""
    q = shlex.join
    if kind == "megatron":
        body = q(_torchrun(lay, "${NODE_RANK:-0}", "${MASTER_ADDR:-localhost}") + ["pretrain_gpt.py", *megatron_args(lay)])
        body = body.replace("'${NODE_RANK:-0}'", '"${NODE_RANK:-0}"').replace("'${MASTER_ADDR:-localhost}'",
                                                                              '"${MASTER_ADDR:-localhost}"')
        return {"megatron.sh": "#!/bin/bash\n# Megatron-LM: add the data, tokenizer and optimizer arguments.\n"
                               f"# run on each of the {lay.nodes} nodes with NODE_RANK and MASTER_ADDR set\n{body} \"$@\"\n"}
    train = ["computron", "train", *train_args(lay, model or lay.model, steps)]
    if kind == "torchrun":
        return {f"torchrun_node{i}.sh": f"#!/bin/bash\n{q(_torchrun(lay, str(i), 'NODE0_ADDRESS') + ['--no-python', *train])}\n"
                for i in range(lay.nodes)}
    if kind == "slurm":
        cmd = q(_torchrun(lay, "$SLURM_NODEID", "$MASTER_ADDR") + ["--no-python", *train])
        cmd = cmd.replace("'$SLURM_NODEID'", "$SLURM_NODEID").replace("'$MASTER_ADDR'", "$MASTER_ADDR")
        return {"train.sbatch": "#!/bin/bash\n"
                                f"#SBATCH --nodes={lay.nodes}\n#SBATCH --ntasks-per-node=1\n"
                                f"#SBATCH --gpus-per-node={lay.gpus_per_node}\n#SBATCH --exclusive\n"
                                'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
                                f"srun bash -c '{cmd}'\n"}
    raise LaunchError(f"unknown --emit {kind!r} (megatron, torchrun, slurm)")


def _command(text: str) -> list[str]:
    """The ``torchrun ...`` command of an emitted file, as words."""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("srun bash -c "):
            line = shlex.split(line)[3]
        if line.startswith("torchrun "):
            return shlex.split(line)
    raise LaunchError("no torchrun command in the launch file")


def parse_emitted(text: str, lay_model: Layout | None = None) -> Layout:
    """The layout an emitted launch file starts (megatron, torchrun or slurm), the model's name
    taken from ``lay_model`` when the file does not say it."""
    words = _command(text)
    tr = argparse.ArgumentParser(add_help=False)
    for k in ("--nnodes", "--nproc-per-node"):
        tr.add_argument(k, type=int)
    runner, rest = tr.parse_known_args(words[1:])
    world = runner.nnodes * runner.nproc_per_node
    if "pretrain_gpt.py" in rest:
        p = argparse.ArgumentParser(add_help=False)
        for k in ("tensor-model-parallel-size", "pipeline-model-parallel-size", "micro-batch-size",
                  "global-batch-size", "seq-length", "num-layers", "hidden-size", "num-attention-heads",
                  "ffn-hidden-size", "num-query-groups", "decoder-first-pipeline-num-layers",
                  "decoder-last-pipeline-num-layers", "num-layers-per-virtual-pipeline-stage"):
            p.add_argument("--" + k, type=int)
        p.add_argument("--recompute-granularity")
        p.add_argument("--use-distributed-optimizer", action="store_true")
        a, _ = p.parse_known_args(rest[rest.index("pretrain_gpt.py") + 1:])
        tp, pp, L = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.num_layers
        if a.decoder_first_pipeline_num_layers is not None:
            first, last = a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers
            mid = (L - first - last) // (pp - 2) if pp > 2 else 0
            part = (first, *[mid] * (pp - 2), last)
        else:
            part = tuple([L // pp] * pp)
        v = L // (pp * a.num_layers_per_virtual_pipeline_stage) if a.num_layers_per_virtual_pipeline_stage else 1
        return Layout(model=lay_model.model if lay_model else "?", layers=L, hidden=a.hidden_size,
                      heads=a.num_attention_heads, ffn=a.ffn_hidden_size, vocab=lay_model.vocab if lay_model else 0,
                      kv_heads=a.num_query_groups or a.num_attention_heads, dp=world // (tp * pp), tp=tp, pp=pp,
                      mbs=a.micro_batch_size, global_batch=a.global_batch_size, seq_len=a.seq_length,
                      partition=part, virtual_stages=v, recompute=a.recompute_granularity == "full",
                      zero1=a.use_distributed_optimizer, nodes=runner.nnodes)
    from ..models import resolve_model
    from . import cli

    sub = argparse.ArgumentParser().add_subparsers()
    cli.add_parser(sub)
    args = sub.choices["train"].parse_args(rest[rest.index("train") + 1:])
    c, _ = resolve_model(args.model)
    v = args.virtual_stages
    chunks = [int(x) for x in args.partition.split(",")] if args.partition else [c.num_layers]
    part = tuple(sum(chunks[k * args.pp + s] for k in range(v)) for s in range(args.pp))
    return Layout(model=args.model, layers=c.num_layers, hidden=c.hidden_size, heads=c.num_heads, ffn=c.ffn_size,
                  vocab=c.vocab_size, kv_heads=c.kv_heads, dp=args.dp, tp=args.tp, pp=args.pp, mbs=args.micro_batch,
                  global_batch=args.global_batch, seq_len=args.seq_len, partition=part, virtual_stages=v,
                  recompute=args.recompute, zero1=args.zero1, nodes=runner.nnodes)


# ---- the planner's sub-command -----------------------------------------------------------------

def add_parser(sub) -> None:
    p = sub.add_parser("launch", help="run a plan's layout here, or write its launch files (--emit)",
                       description=__doc__.splitlines()[0])
    p.add_argument("plan", help="plan JSON from 'plan estimate --json' or 'plan search --json'")
    p.add_argument("--index", type=int, default=1, help="which plan of a search (1: the best)")
    p.add_argument("--model", default=None, help="preset or checkpoint to train (default: the plan's model, "
                                                 "when it is a preset); its shape must be the plan's")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda (one GPU per rank) or cpu (gloo ranks, for tiny models)")
    p.add_argument("--emit", choices=("megatron", "torchrun", "slurm"), help="write launch files instead of running")
    p.add_argument("--out", default=".", help="directory for --emit's files")
    p.add_argument("--json", default=None, help="per-step records of the local run")
    p.set_defaults(func=cmd_launch)


def cmd_launch(args) -> int:
    import sys

    try:
        lay = read_plan(args.plan, args.index)
        if args.emit:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            for name, text in emit(lay, args.emit, args.model, args.steps).items():
                (out / name).write_text(text)
                (out / name).chmod(0o755)
                print(f"wrote {out / name}")
            return 0
        print(f"launching {lay.model}: dp={lay.dp} tp={lay.tp} pp={lay.pp} mbs={lay.mbs} global batch "
              f"{lay.global_batch} layers {list(lay.partition)} v={lay.virtual_stages} recompute={lay.recompute} "
              f"zero1={lay.zero1}", flush=True)
        return launch_local(lay, args.model, args.steps, args.device, args.json)
    except LaunchError as e:
        print(f"computron plan launch: {e}", file=sys.stderr)
        return 2

