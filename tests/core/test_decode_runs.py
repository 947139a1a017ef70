"""Runs of several decode steps per call (``EngineConfig.decode_steps``): each step's tokens are fed
to the next on the device, and the host reads the whole run's tokens at once. Whatever the run
length, every request's tokens (and log-probabilities) equal those of single steps: greedy and
seeded sampling, prompts of different lengths, runs that cross KV-block boundaries, requests that
join a running batch, stop strings inside a run, preemption under a small budget."""

import pytest

from computron.config import EngineConfig
from computron.engine import Engine, SamplingParams
from computron.memory.units import kv_region_bytes

PROMPTS = ["hello", "the quick brown fox jumps", "swap me in", "1 2 3", "Ünïcödé ✓", "a" * 40]
MIXED = [SamplingParams(max_tokens=37, temperature=0.0, ignore_eos=True),
         SamplingParams(max_tokens=29, temperature=1.0, seed=5, ignore_eos=True),
         SamplingParams(max_tokens=40, temperature=0.8, top_k=20, seed=9, ignore_eos=True),
         SamplingParams(max_tokens=33, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True),
         SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True),
         SamplingParams(max_tokens=40, temperature=1.2, top_k=5, top_p=0.8, seed=3, ignore_eos=True)]


def engine(model: str, decode_steps: int, budget=64 * 2**20) -> Engine:
    eng = Engine(EngineConfig(device="cpu", gpu_memory_budget=budget, workspace_bytes=50_000,
                              decode_steps=decode_steps))
    eng.register_model(model)
    return eng


def count_runs(eng: Engine) -> list[int]:
    """The ``steps`` of every batch the executor is asked to run."""
    seen, inner = [], eng.executor.execute

    def execute(batches):
        seen.extend(b.steps for b in batches)
        return inner(batches)

    eng.executor.execute = execute
    eng.core.executor = eng.executor
    return seen


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-opt"])
def test_runs_equal_single_steps(model):
    one, run = engine(model, 1), engine(model, 8)
    runs = count_runs(run)
    want = [one.submit(model, p, sp) for p, sp in zip(PROMPTS, MIXED)]
    one.run_until_done(want)
    got = [run.submit(model, p, sp) for p, sp in zip(PROMPTS, MIXED)]
    run.run_until_done(got)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.text for r in got] == [r.text for r in want]
    assert [len(r.output_ids) for r in got] == [sp.max_tokens for sp in MIXED]
    assert max(runs) == 8 and sum(runs) < sum(sp.max_tokens for sp in MIXED)  # runs really happened


def test_late_joiners_and_stop_strings_inside_runs():
    one, run = engine("tiny-llama", 1), engine("tiny-llama", 8)
    ref = one.generate("tiny-llama", "the quick brown fox jumps", MIXED[0])
    stop = ref.text[len(ref.text) // 2: len(ref.text) // 2 + 3]  # a stop string met inside a run
    params = SamplingParams(max_tokens=37, temperature=0.0, ignore_eos=True, stop=(stop,))
    want = one.generate("tiny-llama", "the quick brown fox jumps", params)
    assert want.finish_reason == "stop" and len(want.output_ids) < 37
    first = run.submit("tiny-llama", "the quick brown fox jumps", params)
    run.step(); run.step(); run.step()  # a run is under way when the next request comes
    late = run.submit("tiny-llama", PROMPTS[3], MIXED[4])
    run.run_until_done([first, late])
    assert (first.output_ids, first.text, first.finish_reason) == (want.output_ids, want.text, "stop")
    assert late.output_ids == one.generate("tiny-llama", PROMPTS[3], MIXED[4]).output_ids
    assert run.memory()["kv"] == 0


def test_runs_with_logprobs_and_penalties_equal_single_steps():
    """Rows whose sampling needs the host between steps take them one at a time inside the run."""
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=20, temperature=0.9, seed=1, ignore_eos=True, frequency_penalty=0.5),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, min_tokens=10)]
    one, run = engine("tiny-opt", 1), engine("tiny-opt", 6)
    runs = count_runs(run)
    want = [one.submit("tiny-opt", p, sp) for p, sp in zip(PROMPTS, params)]
    one.run_until_done(want)
    got = [run.submit("tiny-opt", p, sp) for p, sp in zip(PROMPTS, params)]
    run.run_until_done(got)
    assert max(runs) == 6
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert len(got[0].logprobs) == 20
    for (a, top_a), (b, top_b) in zip(got[0].logprobs, want[0].logprobs):
        assert a == pytest.approx(b, abs=1e-5)
        assert [t for t, _ in top_a] == [t for t, _ in top_b]


def test_runs_keep_the_logit_bias():
    """A biased row's logits go through the host every step: a run fed on the device dropped the bias
    after its first step (the banned token came back)."""
    one, run = engine("tiny-llama", 1), engine("tiny-llama", 8)
    free = one.generate("tiny-llama", PROMPTS[1], MIXED[0]).output_ids
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logit_bias={free[2]: -100.0})
    want = one.generate("tiny-llama", PROMPTS[1], params).output_ids
    assert free[2] not in want and want != free[:20]
    assert run.generate("tiny-llama", PROMPTS[1], params).output_ids == want


def test_runs_under_preemption_equal_undisturbed_requests():
    ref = engine("tiny-llama", 1)
    weights, per_token = ref.models["tiny-llama"].nbytes, ref.models["tiny-llama"].info.kv_bytes_per_token[0]
    block = kv_region_bytes(ref.executor.status().kv_block_tokens, per_token)
    prompts = [list(range(10 + i, 30 + i)) for i in range(4)]
    params = MIXED[:4]
    want = [ref.generate("tiny-llama", p, sp).output_ids for p, sp in zip(prompts, params)]
    eng = engine("tiny-llama", 8, budget=weights + 10 * block + 512 + 50_000)
    reqs = [eng.submit("tiny-llama", p, sp) for p, sp in zip(prompts, params)]
    eng.run_until_done(reqs)
    assert eng.stats["preemptions"] >= 1
    assert [r.output_ids for r in reqs] == want
    assert eng.memory()["kv"] == 0


def test_decode_steps_is_validated():
    with pytest.raises(ValueError, match="decode_steps must be an integer from 1 to 64, got 0"):
        EngineConfig(decode_steps=0)
