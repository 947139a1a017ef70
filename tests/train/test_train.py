"""The training job on the CPU (fp32): micro-batch changes keep the update, abandoned micro-batches
are redone, checkpoints resume exactly, and the dense forward equals the serving forward."""

import threading

import pytest
import torch

from computron.models.kvcache import KVPool, block_bytes, paged_batch
from computron.models.transformer import DenseBatch
from computron.train.config import TrainConfig
from computron.train.job import Trainer

CFG = dict(model="tiny-opt", seq_len=16, global_batch=8, micro_batch=8, steps=3, lr=1e-3, synthetic_tokens=4096)


def params(tr):
    return {n: p.detach().clone() for n, p in tr.params.items()}


class Sizes:
    """A scripted micro-batch size per call, standing in for what colocation picks."""

    def __init__(self, colo, sizes):
        self.colo, self.sizes = colo, list(sizes)
        colo.micro_batch = lambda most: min(most, self.sizes.pop(0) if self.sizes else most)


def test_changing_micro_batch_gives_the_same_parameters_after_each_step():
    ref = Trainer(TrainConfig(**CFG))
    got = Trainer(TrainConfig(**CFG))
    Sizes(got.colo, [3, 5, 1, 1, 2, 4, 2, 6])
    for step in range(3):
        r, g = ref.train_step(), got.train_step()
        assert r["micro_batches"] == [8] and sum(g["micro_batches"]) == 8 and len(g["micro_batches"]) > 1
        assert abs(r["loss"] - g["loss"]) < 1e-5
        for name, p in ref.params.items():  # the same gradients within float32 rounding (sums taken in
            # another order: an entry that nearly cancels differs by a fraction of the tensor's largest
            # entry, not of itself); after the first step the parameters differ by Adam's rounding too,
            # and the gradients with them, so the later steps are judged by their parameters below ...
            scale = p.grad.abs().max().item() * (1e-5 if step == 0 else 1e-3)
            torch.testing.assert_close(got.params[name].grad, p.grad, rtol=1e-4, atol=scale)
        for name, p in params(ref).items():  # ... so the same update (Adam amplifies rounding of ~0 gradients)
            torch.testing.assert_close(got.params[name].detach(), p, rtol=1e-5, atol=1e-2 * CFG["lr"])
    assert ref.samples_seen == got.samples_seen


def test_a_micro_batch_limit_is_split_evenly():
    """A limit of 5 samples on a batch of 8 runs 4 + 4 (not 5 + 3), 3 runs 3 + 3 + 2: as many
    micro-batches as the limit needs, none larger than the others by more than one sample."""
    for most, want in ((5, [4, 4]), (3, [3, 3, 2]), (8, [8]), (7, [4, 4])):
        tr = Trainer(TrainConfig(**{**CFG, "steps": 1}))
        tr.colo.micro_batch = lambda _most, most=most: most
        assert tr.train_step()["micro_batches"] == want, most


def test_an_abandoned_micro_batch_is_redone_with_the_same_data_and_loss():
    ref = Trainer(TrainConfig(**{**CFG, "micro_batch": 4}))
    got = Trainer(TrainConfig(**{**CFG, "micro_batch": 4}))
    colo = got.colo
    per = colo.memory.predict(2) - colo.memory.predict(1)
    calls = {"n": 0}

    def interrupt(grad):  # in the backward of the 3rd micro-batch, a limit that fits only 2 samples
        calls["n"] += 1
        if calls["n"] == 3:
            colo.deliver({"t": "limit", "id": 1, "bytes": colo.memory.predict(2) + per // 2, "immediate": True})
        return grad

    def watch(_mod, _inp, out):
        out.register_hook(interrupt)

    got.model.layers[1].mlp.register_forward_hook(watch)
    lr = [ref.train_step() for _ in range(3)]
    lg = [got.train_step() for _ in range(3)]
    assert colo.abandoned == 1
    assert [r["micro_batches"] for r in lg] == [[4, 4], [2, 2, 2, 2], [2, 2, 2, 2]]
    assert got.samples_seen == ref.samples_seen
    assert abs(lg[-1]["loss"] - lr[-1]["loss"]) < 1e-5
    for name, p in params(ref).items():
        torch.testing.assert_close(got.params[name].detach(), p, rtol=1e-5, atol=1e-2 * CFG["lr"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_pause_mid_step_parks_the_state_and_the_run_equals_an_undisturbed_one(dtype):
    """Paused between the two micro-batches of step 2 (gradients half accumulated, AdamW moments
    present): the state goes to host buffers and comes back, the bf16 copies are remade, and every
    parameter ends equal to a run that never paused."""
    cfg = TrainConfig(**{**CFG, "micro_batch": 4, "dtype": dtype})
    ref, got = Trainer(cfg), Trainer(cfg)
    colo, calls, pick = got.colo, [], got.colo.micro_batch

    def micro_batch(most):
        calls.append(most)
        if len(calls) == 4:  # step 2, second micro-batch: no room for one sample until 0.2 s later
            colo.deliver({"t": "limit", "id": 1, "bytes": 0, "immediate": False})
            threading.Timer(0.2, colo.deliver,
                            args=({"t": "limit", "id": 2, "bytes": 1 << 40, "immediate": False},)).start()
        return pick(most)

    colo.micro_batch = micro_batch
    times = []
    for _ in range(3):
        r, g = ref.train_step(), got.train_step()
        assert g["micro_batches"] == [4, 4] and r["loss"] == g["loss"]
        times.append(g["time_s"])
    assert times[1] >= 0.2 and colo.paused_s > 0 and got.parking.parked_bytes > 0 and not got.parking.parked
    masters = sum(p.numel() * 4 for p in got.params.values())
    assert got.parking.parked_bytes == 4 * masters  # masters, gradients, two moments
    for name, p in params(ref).items():
        torch.testing.assert_close(got.params[name].detach(), p, rtol=0, atol=0)


def test_resume_from_a_checkpoint_continues_exactly(tmp_path):
    ref = Trainer(TrainConfig(**{**CFG, "steps": 4}))
    ref.run()
    first = Trainer(TrainConfig(**{**CFG, "steps": 2}, checkpoint=str(tmp_path / "ck")))
    first.run()
    assert (tmp_path / "ck" / "model" / "model.safetensors").is_file()
    second = Trainer(TrainConfig(**{**CFG, "steps": 4}, checkpoint=str(tmp_path / "ck"), resume=True))
    assert second.step_no == 2
    second.run()
    for name, p in params(ref).items():
        torch.testing.assert_close(second.params[name].detach(), p, rtol=0, atol=0)
    assert second.samples_seen == ref.samples_seen[2:]


def test_dense_training_forward_equals_the_paged_serving_forward():
    tr = Trainer(TrainConfig(model="tiny-llama", seq_len=8))
    ids = torch.randint(0, 512, (2, 8))
    positions = torch.arange(8).repeat(2)
    with torch.no_grad():
        dense = tr.model(ids.reshape(-1), positions, DenseBatch(2))
        bb = block_bytes(tr.model_cfg, 4)
        pool = KVPool(torch.zeros(8 * bb, dtype=torch.uint8), tr.model_cfg, 4, bb)
        batch = paged_batch(pool, [([0, 1], 0, 8), ([2, 3], 0, 8)], torch.device("cpu"))
        paged = tr.model(ids.reshape(-1), positions, batch)
    torch.testing.assert_close(dense, paged, rtol=1e-4, atol=1e-5)


def test_recomputation_changes_memory_not_results():
    def run(recompute):
        tr = Trainer(TrainConfig(**{**CFG, "recompute": recompute}))
        saved = []  # bytes autograd keeps for the backward, as the forward saves them

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = tr.train_step()["loss"]
        return loss, params(tr), sum(saved)

    loss, p, full = run(False)
    loss_r, p_r, kept = run(True)
    assert loss_r == loss and kept < 0.5 * full, (kept, full)
    for name, x in p.items():
        torch.testing.assert_close(p_r[name], x, rtol=0, atol=0)


def test_a_sequence_longer_than_the_learned_positions_is_refused():
    import pytest

    from computron.models import get_preset

    n = get_preset("tiny-gpt2").max_position
    with pytest.raises(ValueError, match=f"seq_len {n + 1} exceeds the {n} positions tiny-gpt2 has learned"):
        Trainer(TrainConfig(**{**CFG, "model": "tiny-gpt2", "seq_len": n + 1}))


def test_cuda_graphs_are_refused_where_they_cannot_run():
    import pytest

    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device and no colocation: got device cpu"):
        Trainer(TrainConfig(**{**CFG, "cuda_graphs": True}))
    from computron.train.job import graphs_refused

    assert graphs_refused("cuda") is None and graphs_refused("cuda:1") is None  # any layout, pipelines too
    assert "no colocation: got device cuda, colocation" in graphs_refused("cuda", colocate=True)


def test_the_head_over_a_padded_vocabulary_gives_the_same_logits_and_gradients():
    """Training's head pads the vocabulary rows for the matrix kernel: same logits and gradients."""
    import dataclasses

    from computron.models import get_preset
    from computron.models.transformer import DecoderLM, bind_weights

    torch.manual_seed(0)
    model = DecoderLM(dataclasses.replace(get_preset("tiny-gpt2"), vocab_size=500))
    bind_weights(model, {n: torch.randn(p.shape) * 0.05 for n, p in model.named_parameters()})
    for p in model.parameters():
        p.requires_grad_(True)
    assert model.embed_tokens.shape[0] % 128  # the case that pads
    x = torch.randn(5, model.cfg.hidden_size)
    grads = []
    for align in (1, 128):
        model.zero_grad()
        out = model.head(x, align)
        assert out.shape == (5, model.cfg.vocab_size)
        (out * torch.arange(out.shape[1])).sum().backward()
        grads.append((out.detach(), model.embed_tokens.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])


def test_bf16_computes_with_weight_copies_refreshed_from_float32_masters():
    fp32 = Trainer(TrainConfig(**CFG))
    whole = Trainer(TrainConfig(**{**CFG, "dtype": "bfloat16"}))
    split = Trainer(TrainConfig(**{**CFG, "dtype": "bfloat16"}))
    Sizes(split.colo, [3, 5, 8, 2, 6, 8])  # bf16 gradients of micro-batches added into float32 accumulators
    for step in range(3):
        r, w, g = fp32.train_step(), whole.train_step(), split.train_step()
        assert abs(r["loss"] - g["loss"]) < 1e-3 * r["loss"] and abs(w["loss"] - g["loss"]) < 1e-3 * r["loss"]
        for (name, p), cw in zip(split.params.items(), split.work):
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32 and cw.dtype == torch.bfloat16, name
            assert torch.equal(cw, p.detach().to(torch.bfloat16)), f"{name}: the copy was not refreshed after the update"
            if step == 0:  # the same weights yet (later, Adam amplifies the rounding of ~0 gradients)
                # a lost or doubled micro-batch would be off by 25% or more
                near = whole.params[name].grad
                assert (p.grad - near).norm() <= 0.03 * near.norm(), f"{name}: split against whole bf16 batch"
                far = fp32.params[name].grad
                assert (p.grad - far).norm() <= 0.1 * far.norm(), f"{name}: bf16 against float32"
    assert dict(split.model.named_parameters())["layers.0.mlp.up_weight"].dtype == torch.bfloat16


def test_in_place_cross_entropy_equals_torchs_in_float32():
    import torch.nn.functional as F

    from computron.train.job import SoftmaxCrossEntropy

    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 300, (64,), generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(64, 300, generator=gen) * 4).to(dtype).requires_grad_(True)
        ref = logits.detach().float().requires_grad_(True)
        before = logits.detach().clone()
        want = F.cross_entropy(ref, targets, reduction="sum")
        got = SoftmaxCrossEntropy.apply(logits, targets)
        (0.5 * want).backward()
        (0.5 * got).backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-4)
        assert logits.grad.dtype == dtype
        torch.testing.assert_close(logits.grad.float(), ref.grad, **({} if dtype == torch.float32 else
                                                                     dict(rtol=1e-2, atol=1e-3)))
        assert torch.equal(logits.detach(), before)  # the input was not changed in place


def test_a_colocated_job_fences_every_four_points_or_at_its_bound(tmp_path):
    addr = str(tmp_path / "none.sock")  # no arbiter there: the job runs its bound with no limit
    def colo(**kw):
        tr = Trainer(TrainConfig(**CFG, colocate=addr, **kw))
        tr.colo.close()
        return tr.colo.run_ahead, tr.colo.fence_every

    assert colo() == (8, 4)
    assert colo(colocate_run_ahead=2) == (2, 2)
    assert colo(colocate_run_ahead=32, colocate_fence_every=1) == (32, 1)
    assert Trainer(TrainConfig(**CFG)).colo.run_ahead == 0  # not colocated: no fences at all
    with pytest.raises(ValueError, match=r"fence_every must be from 1 to run_ahead \(2\), got 3"):
        colo(colocate_run_ahead=2, colocate_fence_every=3)
    with pytest.raises(ValueError, match="fence_every must be from 1 to run_ahead"):
        colo(colocate_fence_every=0)  # not taken for the default


def test_the_job_reserves_the_host_buffers_of_a_pause_beside_training():
    logs = []
    tr = Trainer(TrainConfig(**CFG), log=logs.append)
    tr.train_step()  # the optimizer's state exists from here
    tr.reserve_parking().join(30)
    params = list(tr.params.values())
    state = params + [p.grad for p in params if p.grad is not None]
    state += [v for st in tr.opt.state.values() for k, v in st.items() if torch.is_tensor(v) and k != "step"]
    assert len(state) == 4 * len(params)  # weights, gradients, two moments
    assert tr.parking.reserved_bytes == sum(t.numel() * t.element_size() for t in state)
    assert any("reserved for a pause" in line for line in logs), logs
