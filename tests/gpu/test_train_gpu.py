"""The trainer on CUDA in bf16 (bf16 weight copies, float32 masters and gradients, fused AdamW)
against the same job in float32, and the profile's measured head and recomputed layer on CUDA:
run on the lent GPU machine with `pytest -m gpu tests/gpu/test_train_gpu.py`."""

import pytest
import torch

from computron.train.config import TrainConfig
from computron.train.job import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CFG = dict(model="tiny-llama", seq_len=64, global_batch=8, micro_batch=4, steps=4, lr=1e-3, device="cuda",
           synthetic_tokens=1 << 14)


def test_bf16_training_follows_float32_and_keeps_its_books():
    ref = Trainer(TrainConfig(**CFG, dtype="float32"))
    got = Trainer(TrainConfig(**CFG, dtype="bfloat16"))
    assert got.opt.defaults.get("fused") is True
    r = [ref.train_step() for _ in range(4)]
    g = [got.train_step() for _ in range(4)]
    for a, b in zip(r, g):  # the same data and updates: the losses agree to bf16's rounding
        assert abs(a["loss"] - b["loss"]) < 0.01 * a["loss"], (a["loss"], b["loss"])
        assert b["micro_batches"] == [4, 4] and b["peak_bytes"][0] > 0
    for (name, p), w in zip(got.params.items(), got.work):
        assert p.is_cuda and p.dtype == torch.float32 and w.dtype == torch.bfloat16, name
        assert torch.equal(w, p.detach().to(torch.bfloat16)), name
    # the masters moved as the float32 job's did (Adam's step is lr-sized: compare within a few steps of it)
    for name, p in ref.params.items():
        torch.testing.assert_close(got.params[name].detach(), p.detach(), rtol=0, atol=4 * 4 * CFG["lr"])


def test_profile_measures_head_and_recompute_on_cuda():
    from computron.planner.model import TransformerShape
    from computron.planner.profile import run_profile

    import gc

    m = TransformerShape("l", "llama", 2, 256, 4, 688, 1024, 128, 8, kv_heads=2, flash_attention=True,
                         dtype="bfloat16")
    run_profile(m, [1], [1], device="cuda", warmup=1, repeats=1, log=lambda s: None)  # the streams' workspaces
    gc.collect()
    before = torch.cuda.memory_allocated()
    got = run_profile(m, [1], [1, 2], device="cuda", warmup=2, repeats=3, log=lambda s: None)
    gc.collect()
    parts = {(e.get("part", "layer"), e["mbs"]) for e in got["entries"]}
    assert parts == {(p, b) for p in ("layer", "head", "recompute") for b in (1, 2)}
    assert got["dtype"] == "bfloat16" and got["layer"] == "runtime"
    for e in got["entries"]:  # a layer this small is host-bound eager: its graph replays faster
        if e.get("part", "layer") != "head":
            assert 0 < e["graph_s"] < e["step_s"], e
    assert torch.cuda.memory_allocated() - before < 2**20  # nothing of the profile stays allocated


def test_a_pause_frees_the_device_through_pinned_buffers_and_a_stopped_resume_frees_its_copies():
    tr = Trainer(TrainConfig(**CFG, dtype="bfloat16"))
    tr.train_step()
    before = {n: p.detach().clone() for n, p in tr.params.items()}
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated()
    tr._pause()
    state = 4 * sum(p.numel() * 4 for p in tr.params.values())  # masters, gradients (None here: 3), moments
    freed = used - torch.cuda.memory_allocated()
    assert tr.parking.parked_bytes >= 3 * state // 4 and freed >= tr.parking.parked_bytes
    assert all(b.is_pinned() for b in tr.parking._host.values())
    assert all(not p.is_cuda for p in tr.params.values())
    assert not tr.parking.unpark(lambda: True)  # an order during the resume: its copies are dropped
    assert abs(torch.cuda.memory_allocated() - (used - freed)) < (1 << 20)
    assert tr._resume()
    for n, p in tr.params.items():
        assert p.is_cuda and torch.equal(p.detach(), before[n]), n
    for w, p in zip(tr.work, tr.params.values()):
        assert torch.equal(w, p.detach().to(torch.bfloat16))
    tr.train_step()  # and training goes on


@pytest.mark.parametrize("recompute", [False, True])
def test_cuda_graphs_train_as_the_eager_trainer_does(recompute):
    # 10 samples in micro-batches of 4: sizes 4, 3, 3, so two graphs, one replayed twice a step
    cfg = {**CFG, "global_batch": 10, "dtype": "float32", "recompute": recompute}
    ref, got = Trainer(TrainConfig(**cfg)), Trainer(TrainConfig(**cfg, cuda_graphs=True))
    for _ in range(3):
        a, b = ref.train_step(), got.train_step()
        assert b["micro_batches"] == a["micro_batches"] == [4, 3, 3]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert sorted(got._graphs) == [3, 4] and got._graph_bytes > 0
    # a replay allocates nothing: the graphs' pool counted, the peak is the eager one's, give or take
    assert 0.8 * a["peak_bytes"][0] < b["peak_bytes"][0] < 1.6 * a["peak_bytes"][0], (a["peak_bytes"], b["peak_bytes"])
    for name, p in ref.params.items():
        torch.testing.assert_close(got.params[name].detach(), p.detach(), rtol=1e-4, atol=1e-5)


def _tp_worker(out):
    import faulthandler
    import json

    from computron.train import dist as tdist

    faulthandler.dump_traceback_later(150, exit=True)  # a rank that hangs prints where, then fails the job

    tdist.init(tdist.local_device("cuda"), 120.0)
    losses = {}
    for graphs in (False, True):
        tr = Trainer(TrainConfig(**{**CFG, "device": tdist.local_device("cuda"), "dtype": "float32",
                                    "dims": {"tp": 2}, "cuda_graphs": graphs}))
        losses[graphs] = [tr.train_step()["loss"] for _ in range(3)]
        params = {n: p.detach().cpu() for n, p in tr.params.items()}
        if graphs:
            for n, p in params.items():
                torch.testing.assert_close(p, eager[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
        eager = params
    import os

    if os.environ["RANK"] == "0":
        with open(out, "w") as f:
            json.dump({str(k): v for k, v in losses.items()}, f)
    tr.close()  # the graphs go before the group: else destroy_process_group waits on them
    tdist.close()
    return 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
# it hung once, in destroy_process_group with the graphs alive: a failure, not a stalled suite
@pytest.mark.timeout(180)
def test_cuda_graphs_capture_the_tensor_parallel_collectives(tmp_path):
    import json

    from computron.train.dist import spawn

    spawn(2, _tp_worker, str(tmp_path / "losses.json"))  # a rank whose parameters differ fails the job
    got = json.loads((tmp_path / "losses.json").read_text())
    assert got["True"] == pytest.approx(got["False"], rel=1e-5)


def test_an_abandoned_micro_batch_frees_its_activations_at_once():
    """A handover abandons a micro-batch in its backward: by the next micro-batch's start the device
    holds what it held before the abandoned one (its activations and autograd graph are gone without
    waiting for the garbage collector), so the release that follows frees what inference asked for."""
    import gc
    import threading

    tr = Trainer(TrainConfig(**{**CFG, "model": "tiny-opt", "seq_len": 256, "global_batch": 16, "micro_batch": 8},
                             dtype="bfloat16"))
    colo, calls, seen = tr.colo, {"n": 0}, []
    per = colo.memory.predict(2) - colo.memory.predict(1)

    def interrupt(grad):  # in the backward of step 2's first micro-batch: a limit that fits 4 samples
        calls["n"] += 1
        if calls["n"] == 3:
            colo.deliver({"t": "limit", "id": 1, "bytes": colo.memory.predict(4) + per // 2, "immediate": True})
        return grad

    def watch(_mod, _inp, out):  # a forward hook returning something would replace the output
        out.register_hook(interrupt)

    tr.model.layers[1].mlp.register_forward_hook(watch)
    choose = colo.micro_batch

    def micro_batch(most):
        torch.cuda.synchronize()
        seen.append((colo.abandoned, torch.cuda.memory_allocated()))
        return choose(most)

    colo.micro_batch = micro_batch
    done = threading.Event()

    def two_steps():
        tr.train_step()
        tr.train_step()
        done.set()

    gc.disable()
    try:  # in a thread: without the frames cleared, these steps once hung past 9 minutes instead of failing
        threading.Thread(target=two_steps, daemon=True).start()
        assert done.wait(120), "the two steps around the abandoned micro-batch did not end in 120 s"
    finally:
        gc.enable()
    assert colo.abandoned == 1
    before = next(b for a, b in seen[2:] if a == 0)  # step 2's first micro-batch, the one abandoned
    after = next(b for a, b in seen if a == 1)
    assert colo.memory.points[8] - before > (4 << 20)  # a micro-batch of 8 allocates this much and more
    assert after - before < (256 << 10), (before, after)
