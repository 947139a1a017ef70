"""Pipeline stages replayed from CUDA graphs (``train/stage_graphs.py``): the gradients and losses of
the eager stage, with micro-batches in flight in 1F1B's order, under torch's pipeline schedule on one
GPU (two stages of one rank), and in the trainer on two GPUs."""

import pytest
import torch
from torch import nn

from computron.train.stage_graphs import GraphedStage

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).cuda()


def _graphed(module: nn.Module, slots: int) -> GraphedStage:
    return GraphedStage(module, slots, [torch.zeros_like(p) for p in module.parameters()])


def test_micro_batches_in_flight_keep_their_own_activations():
    """f0 f1 b0 f2 b1 b2 (1F1B) through two slots: every input's gradient and the parameters' summed
    gradients (in the stage's accumulators) as the eager module makes them; a third forward in flight is
    refused with the reason."""
    eager, graphed = _mlp(0), _graphed(_mlp(0), slots=2)
    xs = [torch.randn(4, 16, device="cuda", requires_grad=True) for _ in range(3)]
    gs = [torch.randn(4, 16, device="cuda") for _ in range(3)]
    grads = {}
    for name, mod in (("eager", eager), ("graphed", graphed)):
        ins = [x.detach().clone().requires_grad_() for x in xs]
        o0, o1 = mod(ins[0]), mod(ins[1])
        o0.backward(gs[0])
        o2 = mod(ins[2])
        o1.backward(gs[1])
        o2.backward(gs[2])
        made = mod.grads if name == "graphed" else [p.grad for p in mod.parameters()]
        grads[name] = ([i.grad for i in ins], made, [o0, o1, o2])
    for a, b in zip(*(grads[n][0] + grads[n][1] + grads[n][2] for n in ("eager", "graphed"))):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert graphed.captures == 2
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    held = [graphed(x), graphed(x)]
    with pytest.raises(RuntimeError, match="slots are all in flight"):
        graphed(x)
    del held


def test_a_pipeline_schedule_runs_graphed_stages_as_eager_ones(tmp_path):
    """Two stages on one rank under torch's interleaved 1F1B (the slots each chunk needs from the
    schedule's order): the same losses and parameter gradients as the eager stages. NCCL, which sends
    a rank's CUDA tensors to itself (gloo does not)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    from computron.planner.schedule import chunk_peaks, op_order

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        x, t = torch.randn(8, 16, device="cuda"), torch.randn(8, 16, device="cuda")
        loss_fn = lambda o, y: ((o - y) ** 2).mean()  # noqa: E731
        got = {}
        for graphs in (False, True):
            mods = [_mlp(1), _mlp(2)]
            held = chunk_peaks(op_order(1, 2, 4, 0))
            run = [_graphed(m, held[c]) for c, m in enumerate(mods)] if graphs else mods
            stages = [PipelineStage(m, c, 2, torch.device("cuda")) for c, m in enumerate(run)]
            losses = []
            ScheduleInterleaved1F1B(stages, 4, loss_fn=loss_fn, scale_grads=False).step(x, target=t, losses=losses)
            made = [g for st in run for g in st.grads] if graphs else [p.grad for m in mods for p in m.parameters()]
            got[graphs] = ([float(v) for v in losses], [g.clone() for g in made])
        assert got[True][0] == pytest.approx(got[False][0], rel=1e-5)
        for a, b in zip(got[False][1], got[True][1]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


def _pp_worker(out, dims):
    import faulthandler
    import json
    import os

    from computron.train import dist as tdist
    from computron.train.config import TrainConfig
    from computron.train.job import Trainer

    faulthandler.dump_traceback_later(150, exit=True)
    tdist.init(tdist.local_device("cuda"), 120.0)
    losses = {}
    for graphs in (False, True):
        tr = Trainer(TrainConfig(model="tiny-llama", seq_len=64, global_batch=8, micro_batch=2, steps=4, lr=1e-3,
                                 device=tdist.local_device("cuda"), dtype="float32", dims=dims,
                                 cuda_graphs=graphs))
        recs = [tr.train_step() for _ in range(3)]
        losses[graphs] = [r["loss"] for r in recs]
        # the stages' graph pools are counted in the peak (a replay allocates nothing the allocator sees)
        assert all((b > 0) == graphs for b in recs[-1]["graph_bytes"]), recs[-1]["graph_bytes"]
        params = {n: p.detach().cpu() for n, p in tr.params.items()}
        if graphs:
            for n, p in params.items():
                torch.testing.assert_close(p, eager[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
        eager = params
        tr.close()
    if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:  # a rank of the last stage has the losses
        with open(out, "w") as f:
            json.dump({str(k): v for k, v in losses.items()}, f)
    tdist.close()
    return 0


@pytest.mark.parametrize("dims", [{"pp": 2}, {"tp": 2, "pp": 2}, {"dp": 2, "pp": 2}], ids=["pp2", "tp2pp2", "dp2pp2"])
@pytest.mark.timeout(180)
def test_a_two_stage_pipeline_trains_graphed_as_eager(tmp_path, dims):
    import json
    import math

    from computron.train.dist import spawn

    ranks = math.prod(dims.values())
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} CUDA GPUs")
    spawn(ranks, _pp_worker, str(tmp_path / "losses.json"), dims)
    got = json.loads((tmp_path / "losses.json").read_text())
    assert got["True"] == pytest.approx(got["False"], rel=1e-5)
