"""Parallel training on the CPU over real gloo groups: every layout's losses and parameters after a
few steps equal single-process training on the same global batch (fp32, within rounding).

Each layout runs in fresh processes (``train.dist.spawn``, the runtime's own launcher); rank 0
writes the losses and the full parameters (joined from every rank's shard) for the test to
compare with a plain ``Trainer`` in this process.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from computron.models import save_checkpoint
from computron.models.presets import get_preset
from computron.train.config import TrainConfig
from computron.train.dist import RankFailed, spawn
from computron.train.job import Trainer, pipeline_keeps_outputs

STEPS = 3
BASE = TrainConfig(seq_len=8, global_batch=8, micro_batch=2, steps=STEPS, lr=1e-3, synthetic_tokens=2048)


def _worker(jobs, out):
    import torch.distributed as dist

    from computron.train import dist as tdist

    tdist.init("cpu", 60.0)
    try:
        for key, cfg in jobs:
            tr = Trainer(cfg)
            losses = [tr.train_step()["loss"] for _ in range(STEPS)]
            if tr.schedule is not None and not pipeline_keeps_outputs():  # the last stage's outputs, unused,
                stages = getattr(tr.schedule, "_stages", None) or [tr.schedule._stage]  # are not kept (torch's
                assert not any(st.output_chunks for st in stages), key  # own record of them)
            full = {**tr.full_params(), **{"grad." + n: g for n, g in tr.full_params(grads=True).items()}}
            if dist.get_rank() == 0:
                save_file({n: t.contiguous() for n, t in full.items()}, f"{out}/{key}.safetensors")
                with open(f"{out}/{key}.json", "w") as f:
                    json.dump(losses, f)
    finally:
        tdist.close()


def _run(world, jobs, tmp_path):
    spawn(world, _worker, jobs, str(tmp_path))
    return {k: (json.loads((tmp_path / f"{k}.json").read_text()), load_file(str(tmp_path / f"{k}.safetensors")))
            for k, _ in jobs}


def _reference(cfg: TrainConfig):
    tr = Trainer(replace(cfg, dims={}, zero1=False, virtual_stages=1, partition=None))
    losses = [tr.train_step()["loss"] for _ in range(STEPS)]
    return losses, {**tr.full_params(), **{"grad." + n: g for n, g in tr.full_params(grads=True).items()}}


def _assert_same(got, ref, key):
    (losses, params), (ref_losses, ref_params) = got, ref
    assert losses == pytest.approx(ref_losses, rel=1e-5), key
    assert params.keys() == ref_params.keys()
    for name, p in ref_params.items():
        # the last step's gradients (Adam's update would hide a gradient off by a constant
        # factor); the parameters within a fraction of lr (Adam amplifies the rounding of ~0 gradients)
        tol = dict(rtol=2e-3, atol=2e-6) if name.startswith("grad.") else dict(rtol=1e-5, atol=5e-2 * BASE.lr)
        torch.testing.assert_close(params[name], p, **tol, msg=lambda m: f"{key} {name}: {m}")


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    """A 4-layer GQA checkpoint (HF layout, safetensors, random weights): room for 2 stages x 2 chunks; its
    vocabulary of 500 makes the training head pad its product (the last stage's output is then a slice)."""
    cfg = get_preset("tiny-llama").with_(num_layers=4, vocab_size=500)  # not a multiple of the head's padding
    gen = torch.Generator().manual_seed(3)
    from computron.models import checkpoint as ckpt

    views = {n: (torch.randn(s, generator=gen) * 0.05 if len(s) > 1 else torch.ones(s))
             for n, s in ckpt.expected_shapes(cfg).items()}
    return str(save_checkpoint(tmp_path_factory.mktemp("llama4"), cfg, views))


def test_two_ranks_equal_one_process(tmp_path, deep_llama):
    jobs = {
        "dp2": replace(BASE, model="tiny-opt", dims={"dp": 2}),
        "dp2_zero1": replace(BASE, model="tiny-opt", dims={"dp": 2}, zero1=True),
        "tp2_opt": replace(BASE, model="tiny-opt", dims={"tp": 2}),
        "tp2_llama_gqa": replace(BASE, model="tiny-llama", dims={"tp": 2}),
        "tp2_recompute": replace(BASE, model="tiny-opt", dims={"tp": 2}, recompute=True),
        "pp2_opt_tied": replace(BASE, model="tiny-opt", dims={"pp": 2}),
        "pp2_1f1b": replace(BASE, model=deep_llama, dims={"pp": 2}, partition=[3, 1]),
        "pp2_interleaved": replace(BASE, model=deep_llama, dims={"pp": 2}, virtual_stages=2),
        "pp2_recompute": replace(BASE, model=deep_llama, dims={"pp": 2}, recompute=True),
        # 250 ids a rank, padded to 256 columns: the vocabulary-parallel loss leaves the padding out
        "tp2_odd_vocab": replace(BASE, model=deep_llama, dims={"tp": 2}),
    }
    got = _run(2, list(jobs.items()), tmp_path)
    refs = {m: _reference(replace(BASE, model=m)) for m in ("tiny-opt", "tiny-llama", deep_llama)}
    for key, cfg in jobs.items():
        _assert_same(got[key], refs[cfg.model], key)
    # the two schedules and ZeRO-1 against DDP, directly
    _assert_same(got["pp2_interleaved"], got["pp2_1f1b"], "interleaved vs 1F1B")
    _assert_same(got["dp2_zero1"], got["dp2"], "ZeRO-1 vs DDP")


def test_four_ranks_mix_tp_pp_and_dp_pp(tmp_path):
    jobs = {
        "tp2pp2": replace(BASE, model="tiny-opt", dims={"tp": 2, "pp": 2}),
        "dp2pp2": replace(BASE, model="tiny-llama", dims={"dp": 2, "pp": 2}, micro_batch=2),
    }
    got = _run(4, list(jobs.items()), tmp_path)
    for key, cfg in jobs.items():
        _assert_same(got[key], _reference(cfg), key)


def test_bf16_pipeline_folds_its_gradients_into_the_float32_masters(tmp_path):
    cfg = replace(BASE, model="tiny-llama", dims={"pp": 2}, dtype="bfloat16")
    (losses, params), = _run(2, [("pp2_bf16", cfg)], tmp_path).values()
    ref_losses, ref = _reference(cfg)  # one process, the same bf16 micro-batches in a loop
    assert losses == pytest.approx(ref_losses, rel=1e-3)
    assert params.keys() == ref.keys()
    for name, p in ref.items():
        assert p.dtype == torch.float32, name
        tol = dict(rtol=2e-2, atol=1e-4) if name.startswith("grad.") else dict(rtol=1e-3, atol=5e-2 * BASE.lr)
        torch.testing.assert_close(params[name], p, **tol, msg=lambda m: f"{name}: {m}")


def _dies_or_hangs(how):
    import os
    import time

    import torch.distributed as dist

    from computron.train import dist as tdist

    tdist.init("cpu", 3.0)
    tr = Trainer(replace(BASE, model="tiny-opt", dims={"dp": 2}, timeout_s=3.0))
    tr.train_step()
    if dist.get_rank() == 1:
        if how == "dies":
            os._exit(3)
        time.sleep(60)  # alive, but never joins the next collective
    tr.train_step()


@pytest.mark.parametrize("how, error", [("dies", "rank 1 of 2 exited with code 3"), ("hangs", "rank 0 of 2 failed")])
def test_a_rank_that_dies_or_hangs_fails_the_job(how, error):
    import time

    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=error) as e:
        spawn(2, _dies_or_hangs, how)
    assert time.monotonic() - t0 < 40, "the job hung instead of failing"
    if how == "hangs":  # rank 0's collective timed out and said so
        assert "timed out" in str(e.value).lower() or "timeout" in str(e.value).lower(), str(e.value)


def test_train_cli_over_two_processes_records_throughput_and_memory(tmp_path, capsys):
    from computron.cli import main

    out = tmp_path / "train.json"
    assert main(["train", "--nproc", "2", "--tp", "2", "--steps", "2", "--seq-len", "8", "--global-batch", "4",
                 "--micro-batch", "2", "--device", "cpu", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["dims"] == {"dp": 1, "tp": 2, "pp": 1}
    for rec in data["steps"]:
        assert rec["time_s"] > 0 and rec["tokens_per_s"] == pytest.approx(4 * 8 / rec["time_s"])
        assert rec["tflops_per_gpu"] > 0 and len(rec["peak_bytes"]) == 2 and min(rec["peak_bytes"]) > 0
    assert main(["train", "--nproc", "2", "--tp", "3", "--device", "cpu"]) == 2
    assert "dp=? x tp=3 x pp=1 does not make the job's 2 processes" in capsys.readouterr().err


def test_the_last_stage_emits_contiguous_padded_logits_and_the_loss_ignores_the_padding(deep_llama):
    # torch's pipelining refuses a stage output whose strides differ from the ones it inferred: a
    # slice of the padded product (stride 512 over 500 columns) failed every pp run of GPT-2 or OPT
    tr = Trainer(replace(BASE, model=deep_llama))
    ids = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = tr.stages[0](ids)
    assert logits.shape == (2, 8, 512) and logits.is_contiguous()
    targets = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(1))
    want = torch.nn.functional.cross_entropy(logits[..., :500].flatten(0, 1).double(), targets.flatten(),
                                             reduction="sum") / (BASE.global_batch * BASE.seq_len)
    assert tr._loss(logits, targets).item() == pytest.approx(want.item(), rel=1e-5)


def _count_broadcasts(out):
    import torch.distributed as dist

    from computron.train import dist as tdist

    tdist.init("cpu", 60.0)
    calls, real = [], dist.broadcast

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    try:
        tr = Trainer(replace(BASE, model="tiny-opt", dims={"dp": 2}, zero1=True))
        dist.broadcast = counted
        tr.train_step()
        dist.broadcast = real
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump({"broadcasts": len(calls), "tensors": len(tr.params)}, f)
    finally:
        dist.broadcast = real
        tdist.close()


def test_zero1_broadcasts_one_bucket_per_rank_not_one_call_per_tensor(tmp_path):
    """ZeRO-1's update goes out as one broadcast per rank's bucket of masters: per tensor, a step of
    a real model makes hundreds of collectives."""
    spawn(2, _count_broadcasts, str(tmp_path / "n.json"))
    got = json.loads((tmp_path / "n.json").read_text())
    assert got["broadcasts"] == 2 and got["tensors"] > 2, got


def test_a_failed_rank_is_reported_by_its_exceptions_not_the_tail_of_a_message():
    """torch's pipeline wraps a stage's error in one whose message ends in ``kwargs: {}``: the report
    names the last exception (with its message from the next line) and its first cause."""
    from computron.train.dist import _cause

    trace = ("Traceback (most recent call last):\n  File \"stage.py\", line 3\n"
             "ValueError: a graphed stage runs micro-batches of one shape\n\n"
             "The above exception was the direct cause of the following exception:\n\n"
             "RuntimeError: \n            [Stage 1] failed to run forward:\n            kwargs: {}\n")
    assert _cause(trace) == ("RuntimeError: [Stage 1] failed to run forward: "
                             "(caused by ValueError: a graphed stage runs micro-batches of one shape)")
    assert _cause("Traceback\n  File x\nOSError: disk full\n") == "OSError: disk full"
    assert _cause("Exception: boom\n\nThe above exception was the direct cause of the following exception:\n\n"
                  "RuntimeError: wrapped\n") == "RuntimeError: wrapped (caused by Exception: boom)"
    assert _cause("killed\n") == "killed"
    # a C++ error's message names no exception of its own in its frames
    assert _cause("RuntimeError: NCCL error: unhandled\nException raised from recvBytes at Utils.hpp:682 (most "
                  "recent call first):\nframe #0: c10::Error::Error\n") == "RuntimeError: NCCL error: unhandled"
