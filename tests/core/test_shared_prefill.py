"""The choices of one prompt (``Engine.submit_choices``) on the CPU: the prompt is prefilled once,
each choice's tokens equal those of a separate request with its seed, the shared KV blocks are
booked once and freed with their last holder, through aborts, errors and preemptions."""

import pytest
import torch

from computron.config import EngineConfig
from computron.engine import Engine, SamplingParams
from computron.memory.units import kv_region_bytes

PROMPT = list(range(10, 50))  # 40 tokens: two whole blocks of 16 shared, 8 tokens each choice computes


def engine(budget=64 * 2**20, models=("tiny-llama",), **kw) -> Engine:
    eng = Engine(EngineConfig(device="cpu", gpu_memory_budget=budget, workspace_bytes=50_000, **kw))
    for m in models:
        eng.register_model(m)
    return eng


def block_bytes(eng, model="tiny-llama") -> int:
    return kv_region_bytes(eng.executor.status().kv_block_tokens, eng.models[model].info.kv_bytes_per_token[0])


def run(eng, reqs, between=None) -> None:
    """Step until done; after every step the scheduler books exactly what the executor holds."""
    steps = 0
    while not all(r.done for r in reqs):
        eng.step()
        steps += 1
        d = eng.memory()["devices"][0]
        assert d["scheduled"] == d["weights"] + d["kv"], f"step {steps}: booked {d['scheduled']}, held {d}"
        if between:
            between(steps)
    assert eng.memory()["kv"] == 0


def seeded(n, **kw):
    return [SamplingParams(max_tokens=12, temperature=1.0, seed=100 + i, ignore_eos=True, **kw) for i in range(n)]


def test_choices_prefill_once_share_blocks_and_equal_separate_requests():
    eng = engine()
    params = seeded(4, logprobs=2, prompt_logprobs=3)
    alone = [eng.generate("tiny-llama", PROMPT, p) for p in params]
    before, block = eng.stats["prefill_tokens"], block_bytes(eng)
    assert before == 4 * len(PROMPT)
    reqs = eng.submit_choices("tiny-llama", PROMPT, params)
    held = []
    run(eng, reqs, lambda step: held.append(eng.memory()["kv"]))
    assert eng.stats["prefill_tokens"] - before == 40 + 3 * 8
    assert held[0] == (2 + 4 * 1) * block  # the two shared blocks once, and each choice's last one
    assert [r.output_ids for r in reqs] == [a.output_ids for a in alone]
    for r, a in zip(reqs, alone):
        torch.testing.assert_close(torch.tensor([lp for lp, _ in r.logprobs]),
                                   torch.tensor([lp for lp, _ in a.logprobs]), atol=1e-5, rtol=1e-5)
    # the prompt is scored once, for every choice; as a request alone scores it
    assert all(r.prompt_logprobs is reqs[0].prompt_logprobs for r in reqs)
    got, want = reqs[0].prompt_logprobs, alone[0].prompt_logprobs
    assert got[0] is None and len(got) == len(PROMPT)
    torch.testing.assert_close(torch.tensor([lp for lp, _ in got[1:]]), torch.tensor([lp for lp, _ in want[1:]]))
    assert [[i for i, _ in top] for _, top in got[1:]] == [[i for i, _ in top] for _, top in want[1:]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    one = eng.generate("tiny-llama", PROMPT, greedy).output_ids
    four = eng.submit_choices("tiny-llama", PROMPT, [greedy] * 4)
    run(eng, four)
    assert [r.output_ids for r in four] == [one] * 4


def test_a_choice_aborted_or_failed_leaves_the_others_whole():
    """The first choice holds the blocks it computed; once it is aborted the others keep them
    (the last holder frees them); one that fails ends alone too."""
    eng = engine()
    params = seeded(3)
    want = [eng.generate("tiny-llama", PROMPT, p).output_ids for p in params]
    reqs = eng.submit_choices("tiny-llama", PROMPT, params)

    def act(step):
        if step == 2:
            eng.abort(reqs[0].id)
        if step == 5:
            eng.abort(reqs[1].id, "error", "boom")
    run(eng, reqs, act)
    assert reqs[0].finish_reason == "abort" and len(reqs[0].output_ids) == 2
    assert reqs[1].finish_reason == "error" and reqs[1].error == "boom"
    assert reqs[0].output_ids == want[0][:2] and reqs[1].output_ids == want[1][:5]
    assert reqs[2].output_ids == want[2]


def test_choices_preempted_for_growth_resume_and_equal_separate_requests():
    """Room for the model and 8 blocks: four choices of a 20-token prompt (one block shared, one
    each) start, but cannot all grow to 60 tokens; the newest are preempted, and resume sharing
    the blocks of the choices still running."""
    ref = engine()
    prompt = PROMPT[:20]
    params = [SamplingParams(max_tokens=40, temperature=0.9, top_k=30, seed=7 + i, ignore_eos=True) for i in range(4)]
    want = [ref.generate("tiny-llama", prompt, p).output_ids for p in params]
    eng = engine(ref.models["tiny-llama"].nbytes + 8 * block_bytes(ref) + 512 + 50_000)
    reqs = eng.submit_choices("tiny-llama", prompt, params)
    run(eng, reqs)
    assert eng.stats["preemptions"] >= 1
    assert [r.output_ids for r in reqs] == want


@pytest.mark.parametrize("keeps", [False, True])
def test_choices_stopped_by_the_preempt_policy_recompute_and_equal_separate_requests(keeps):
    """One model fits at a time: a request for another model stops every running choice, the other
    model runs, and the choices come back. Recomputing (no one holds the shared blocks then), the
    first recomputes the prompt and its tokens, the others share its blocks again; paused, they
    keep their caches, the shared blocks included, and decode on."""
    ref = engine(models=("tiny-llama", "tiny-opt"))
    params = seeded(3)
    want = [ref.generate("tiny-llama", PROMPT, p).output_ids for p in params]
    other = ref.generate("tiny-opt", "swap", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    eng = engine(950_000, models=("tiny-llama", "tiny-opt"), policy="preempt", max_wait_s=0.0,
                 preempt_keeps_kv=keeps)
    reqs = eng.submit_choices("tiny-llama", PROMPT, params)
    late = []

    def arrive(step):
        if step == 3:
            late.append(eng.submit("tiny-opt", "swap", other.params))
    run(eng, reqs, arrive)
    eng.run_until_done(late)
    stopped = "pauses" if keeps else "preemptions"
    assert eng.stats[stopped] >= 3 and eng.stats["evictions"] >= 1
    if keeps:  # no prefill but the prompt's (its blocks once and each choice's last token) and the late one's
        assert eng.stats["preemptions"] == 0
        bt = eng.executor.status().kv_block_tokens
        prompt = len(PROMPT)
        shared = (prompt - 1) // bt * bt
        assert eng.stats["prefill_tokens"] == prompt + (len(params) - 1) * (prompt - shared) + len(late[0].prompt_ids)
    assert [r.output_ids for r in reqs] == want and late[0].output_ids == other.output_ids
    assert eng.memory()["kv"] == 0


def test_choices_are_queued_all_or_none():
    eng = engine()
    with pytest.raises(ValueError, match="more than the context"):
        eng.submit_choices("tiny-llama", PROMPT, [SamplingParams(), SamplingParams(max_tokens=10**6)])
    assert not eng.requests and eng.model_stats("tiny-llama")["waiting"] == 0
