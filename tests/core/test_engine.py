"""The engine end to end on the CPU with tiny models: swaps, batching, sampling, bad input."""

import asyncio

import pytest

from computron.config import EngineConfig
from computron.engine import AsyncEngine, Engine, EngineError, SamplingParams
from computron.engine.executor import make_executor
from computron.memory.units import kv_region_bytes
from computron.messages import Residency

MODELS = ["tiny-opt", "tiny-llama", "tiny-gpt2"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello", "the quick brown fox", "swap me in", "1 2 3", "Ünïcödé ✓", "abc"]


def make_engine(budget, models=MODELS, **kw):
    eng = Engine(EngineConfig(device="cpu", gpu_memory_budget=budget, workspace_bytes=50_000, **kw))
    for m in models:
        eng.register_model(m)
    return eng


ONE_FITS = 50_000 + 900_000  # each tiny model is ~0.65 MB: one fits in the arena, two do not


def test_swapping_gives_same_tokens_as_no_swapping():
    big = make_engine(64 * 2**20)
    small = make_engine(ONE_FITS)
    jobs = [(MODELS[i % 3], PROMPTS[i % len(PROMPTS)]) for i in range(12)]
    ref = [big.generate(m, p, GREEDY).output_ids for m, p in jobs]
    reqs = [small.submit(m, p, GREEDY) for m, p in jobs]  # interleaved across models
    small.run_until_done(reqs)
    assert [r.output_ids for r in reqs] == ref
    assert big.stats["swap_ins"] == 3 and big.stats["evictions"] == 0
    # Each of the 3 models had to come in at least once, evicting another each time after the first.
    assert small.stats["swap_ins"] >= 3 and small.stats["evictions"] == small.stats["swap_ins"] - 1
    # One at a time, interleaved: every request forces a swap.
    seq = make_engine(ONE_FITS)
    outs = [seq.generate(m, p, GREEDY).output_ids for m, p in jobs]
    assert outs == ref
    assert seq.stats["swap_ins"] == 12 and seq.stats["evictions"] == 11
    assert seq.memory()["weights"] <= ONE_FITS


def test_batching_gives_same_tokens_as_one_at_a_time():
    eng = make_engine(64 * 2**20, models=["tiny-llama"])
    alone = [eng.generate("tiny-llama", p, GREEDY).output_ids for p in PROMPTS]
    reqs = [eng.submit("tiny-llama", p, GREEDY) for p in PROMPTS]
    steps_before = eng.stats["steps"]
    eng.run_until_done(reqs)
    assert [r.output_ids for r in reqs] == alone
    assert eng.stats["steps"] - steps_before == GREEDY.max_tokens  # all six ran in one batch
    # A request joining a running batch mid-way also matches.
    first = eng.submit("tiny-llama", PROMPTS[0], GREEDY)
    eng.step(); eng.step()
    late = eng.submit("tiny-llama", PROMPTS[1], GREEDY)
    eng.run_until_done([first, late])
    assert [first.output_ids, late.output_ids] == alone[:2]


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    eng = make_engine(64 * 2**20, models=["tiny-opt"])
    p = SamplingParams(max_tokens=8, temperature=1.5, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    a = eng.generate("tiny-opt", "abc", p).output_ids
    others = [eng.submit("tiny-opt", "xyz", SamplingParams(max_tokens=8, temperature=1.0, seed=i)) for i in range(3)]
    b = eng.submit("tiny-opt", "abc", p)
    eng.run_until_done(others + [b])
    assert a == b.output_ids
    c = eng.generate("tiny-opt", "abc", SamplingParams(max_tokens=8, temperature=1.5, seed=8, ignore_eos=True))
    assert c.output_ids != a  # another seed, other tokens (256+ choices over 8 draws)


def test_stop_strings_and_max_tokens():
    eng = make_engine(64 * 2**20, models=["tiny-llama"])
    full = eng.generate("tiny-llama", "hello", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert full.finish_reason == "length" and len(full.output_ids) == 12
    stop = full.text[3:5]
    assert stop
    cut = eng.generate("tiny-llama", "hello", SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    deltas = []
    r = eng.submit("tiny-llama", "hello", SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,)),
                   on_update=lambda req, t: deltas.append(t))
    eng.run_until_done([r])
    assert "".join(deltas) == cut.text  # streamed text never shows the stop string


def test_bad_input_errors():
    eng = make_engine(ONE_FITS, models=["tiny-opt"])
    with pytest.raises(EngineError, match="unknown model 'nope'; known models: tiny-opt"):
        eng.submit("nope", "hi")
    with pytest.raises(EngineError, match=r"unknown model 'opt-99b': neither a checkpoint directory nor a preset \(tiny-opt, .*opt-1.3b"):
        eng.register_model("opt-99b")
    with pytest.raises(EngineError, match=r"opt-350m. needs 631.71 MiB of weights, more than the 878.50 KiB the memory budget leaves"):
        eng.register_model("opt-350m")
    with pytest.raises(EngineError, match=r"the prompt has 511 tokens and max_tokens is 16: together 527, 15 more "
                                          r"than the context of 512"):
        eng.submit("tiny-opt", "x" * 510)
    with pytest.raises(ValueError, match="temperature must be between 0 and 100.*top_p must be in"):
        SamplingParams(temperature=-1, top_p=0)
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        SamplingParams(max_tokens=0)
    with pytest.raises(EngineError, match="prompt is empty"):
        eng.submit("tiny-opt", [])
    with pytest.raises(EngineError, match=r"prompt token ids must be integers in \[0, 512\)"):
        eng.submit("tiny-opt", [1, 512])
    with pytest.raises(EngineError, match="already registered"):
        eng.register_model("tiny-opt")
    with pytest.raises(EngineError, match=r"unknown model 'x{77}\.\.\.': not a preset, and not a readable path "
                                          r"\(File name too long\)"):
        eng.register_model("x" * 300)
    with pytest.raises(EngineError, match="a memory budget of 10 bytes leaves no room for weights and KV cache"):
        Engine(EngineConfig(device="cpu", gpu_memory_budget=10))
    with pytest.raises(EngineError, match=r"the memory budget of 40960.00 GiB is more than the .* of this machine's memory"):
        Engine(EngineConfig(device="cpu", gpu_memory_budget="40TiB"))
    assert not eng.requests  # nothing half-submitted


class Faulty:
    """An executor that delegates to a real one and raises where a test says (through the protocol)."""

    def __init__(self, inner):
        self.inner, self.fail_execute, self.fail_load = inner, None, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, batches):
        if self.fail_execute:
            raise RuntimeError(self.fail_execute)
        return self.inner.execute(batches)

    def apply(self, change):
        if self.fail_load and change.load:
            self.inner.apply(Residency(evict=change.evict))
            raise RuntimeError(self.fail_load)
        return self.inner.apply(change)


def faulty_engine(budget, models):
    cfg = EngineConfig(device="cpu", gpu_memory_budget=budget, workspace_bytes=50_000)
    ex = Faulty(make_executor(cfg))
    eng = Engine(cfg, executor=ex)
    for m in models:
        eng.register_model(m)
    return eng, ex


def test_failed_step_fails_its_requests_not_the_engine():
    eng, ex = faulty_engine(64 * 2**20, ["tiny-opt"])
    ex.fail_execute = "device fell over"
    r = eng.submit("tiny-opt", "hi", GREEDY)
    eng.run_until_done([r])
    assert r.finish_reason == "error" and "device fell over" in r.error
    assert eng.memory()["kv"] == 0
    ex.fail_execute = None
    assert eng.generate("tiny-opt", "hi", GREEDY).finish_reason == "length"


def test_compaction_moves_weights_and_kv_in_many_chunks_and_tokens_stay_the_same():
    """Arena: [A][hole h][B][r1's KV blocks][tail t], h one KV block of A, smaller than a block
    of B. Loading C (h < c, t < c <= h + t) compacts: B's weights and r1's blocks slide down by h,
    in many h-sized chunks; r1 must go on to produce the reference tokens."""
    a_, b_, c_ = "tiny-llama", "tiny-opt", "tiny-gpt2"
    ref = make_engine(64 * 2**20, models=[b_])
    sizes = {m: ref.models[m].nbytes for m in [b_]}
    probe = make_engine(64 * 2**20, models=[a_, c_])
    sizes.update({m: probe.models[m].nbytes for m in [a_, c_]})
    bt = probe.executor.status().kv_block_tokens
    block = {m: kv_region_bytes(bt, e.info.kv_bytes_per_token[0])
             for m, e in {**probe.models, **ref.models}.items()}
    h = block[a_]
    prompt1, params1 = list(range(30, 50)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    k1 = 2 * block[b_]  # 20 + 8 tokens: two blocks, taken at the prefill
    assert h < block[b_] and sizes[b_] > 20 * h
    t = sizes[c_] - h
    arena = sizes[a_] + h + sizes[b_] + k1 + t
    eng = Engine(EngineConfig(device="cpu", gpu_memory_budget=arena + 512 + 50_000, workspace_bytes=50_000))
    for m in (a_, b_, c_):
        eng.register_model(m)
    assert eng.memory()["total"] == arena
    want = ref.generate(b_, prompt1, params1).output_ids

    eng.load(a_)
    eng.set_pinned(a_, True)
    ra = eng.submit(a_, [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    eng.step()  # one KV block of A, right behind A
    eng.load(b_)  # B right behind that block
    eng.run_until_done([ra])  # the block is freed: a hole of h in front of B
    r1 = eng.submit(b_, prompt1, params1)
    eng.step()  # r1's two blocks go behind B (the hole is too small for them)
    assert eng.memory()["devices"][0]["compactions"] == 0
    eng.load(c_)  # fits only in the hole and the tail together
    assert eng.memory()["devices"][0]["compactions"] == 1
    eng.run_until_done([r1])
    assert r1.output_ids == want
    assert eng.stats["swap_ins"] == 3 and eng.stats["evictions"] == 0 and eng.stats["preemptions"] == 0


def test_compaction_under_churn_keeps_outputs():
    # Budget with room for one model and a little KV: requests of mixed sizes fragment the arena.
    eng = make_engine(ONE_FITS, models=["tiny-opt", "tiny-llama"])
    ref = make_engine(64 * 2**20, models=["tiny-opt", "tiny-llama"])
    jobs = [("tiny-llama" if i % 3 else "tiny-opt", "x" * (5 + 7 * i % 40)) for i in range(15)]
    params = [SamplingParams(max_tokens=1 + i % 7, temperature=0.0, ignore_eos=True) for i in range(15)]
    reqs = [eng.submit(m, p, sp) for (m, p), sp in zip(jobs, params)]
    eng.run_until_done(reqs)
    assert [r.output_ids for r in reqs] == [ref.generate(m, p, sp).output_ids for (m, p), sp in zip(jobs, params)]
    assert all(r.error is None for r in reqs)


def test_async_stream_and_abort_frees_cache():
    eng = make_engine(64 * 2**20, models=["tiny-opt", "tiny-llama"])
    ref = eng.generate("tiny-llama", "stream", GREEDY).text
    ae = AsyncEngine(eng)

    async def go():
        text = "".join([d.text async for d in ae.stream("tiny-llama", "stream", GREEDY)])
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        agen = ae.stream("tiny-opt", "abc", long)
        await agen.__anext__()
        await agen.aclose()  # the consumer went away
        for _ in range(100):
            if not await ae.run(lambda: bool(eng.requests)):
                break
            await asyncio.sleep(0.01)
        return text, await ae.run(eng.memory)

    try:
        text, mem = asyncio.run(go())
    finally:
        ae.shutdown()
    assert text == ref
    assert mem["kv"] == 0 and not eng.requests


def test_computron_policy_same_tokens():
    legacy = make_engine(64 * 2**20, policy="computron", max_loaded=1)
    ref = make_engine(64 * 2**20)
    jobs = [(MODELS[i % 3], PROMPTS[i % len(PROMPTS)]) for i in range(6)]
    assert [legacy.generate(m, p, GREEDY).output_ids for m, p in jobs] == \
           [ref.generate(m, p, GREEDY).output_ids for m, p in jobs]
    assert legacy.stats["swap_ins"] == 6 and legacy.stats["evictions"] == 5


def test_registration_builds_off_the_engine_and_adds_between_steps():
    eng = make_engine(64 * 2**20, models=["tiny-opt"])
    prepared = eng.build_model("tiny-llama")
    assert "tiny-llama" not in eng.models  # nothing touched yet
    with pytest.raises(EngineError, match="unknown model 'tiny-llama'"):
        eng.model_state("tiny-llama")
    r = eng.submit("tiny-opt", "abc", GREEDY)
    eng.step()
    eng.add_model(prepared)
    assert eng.generate("tiny-llama", "x", GREEDY).finish_reason == "length"
    eng.run_until_done([r])
    with pytest.raises(EngineError, match="already registered"):
        eng.add_model(prepared)
    ae = AsyncEngine(eng)
    try:
        entry = asyncio.run(ae.register_model("tiny-gpt2"))
        assert entry.name == "tiny-gpt2" and eng.model_state("tiny-gpt2") == "offloaded"
    finally:
        ae.shutdown()


def test_failed_swap_fails_its_requests_and_the_engine_recovers():
    eng, ex = faulty_engine(ONE_FITS, MODELS)
    ex.fail_load = "copy engine fell over"
    r = eng.submit("tiny-llama", "hi", GREEDY)
    eng.run_until_done([r])
    assert r.finish_reason == "error" and "swap failed: RuntimeError: copy engine fell over" in r.error
    assert eng.model_state("tiny-llama") == "offloaded" and eng.memory()["weights"] == 0
    ex.fail_load = None
    assert eng.generate("tiny-llama", "hi", GREEDY).finish_reason == "length"


def test_async_loop_answers_every_request_when_a_step_raises(monkeypatch):
    eng = make_engine(64 * 2**20, models=["tiny-opt"])

    def boom(*_, **__):
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(eng, "step", boom)  # the engine (not its compiled core, whose methods are fixed)
    ae = AsyncEngine(eng)
    try:
        req = asyncio.run(ae.generate("tiny-opt", "x", GREEDY))
    finally:
        ae.shutdown()
    assert req.finish_reason == "error" and "scheduler bug" in req.error and not eng.requests


def test_preempted_requests_recompute_and_match_undisturbed_runs():
    """A budget with room for the model and a few KV blocks: four growing requests cannot all
    keep their caches, so the newest are preempted (blocks freed), wait, and recompute. Their
    tokens, greedy and seeded alike, equal those of each request run alone."""
    ref = make_engine(64 * 2**20, models=["tiny-llama"])
    weights, per_token = ref.models["tiny-llama"].nbytes, ref.models["tiny-llama"].info.kv_bytes_per_token[0]
    bt = ref.executor.status().kv_block_tokens
    block = kv_region_bytes(bt, per_token)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.8, top_k=20, seed=9, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)]
    prompts = [list(range(10 + i, 30 + i)) for i in range(4)]  # 20 + 40 tokens: 4 blocks each at the end
    want = [ref.generate("tiny-llama", p, sp).output_ids for p, sp in zip(prompts, params)]
    arena = weights + 10 * block  # all four start (2 blocks each) but cannot all grow to 4
    eng = Engine(EngineConfig(device="cpu", gpu_memory_budget=arena + 512 + 50_000, workspace_bytes=50_000))
    eng.register_model("tiny-llama")
    reqs = [eng.submit("tiny-llama", p, sp) for p, sp in zip(prompts, params)]
    eng.run_until_done(reqs)
    assert eng.stats["preemptions"] >= 1
    assert [r.output_ids for r in reqs] == want
    assert eng.memory()["kv"] == 0


@pytest.mark.parametrize("executor", ["inprocess", "workers"])
@pytest.mark.parametrize("budget,keeps", [(950_000, True), (870_000, True), (950_000, False)])
def test_paused_requests_keep_their_cache_and_match_undisturbed_runs(executor, budget, keeps):
    """Two models, room for one and the caches of both: under the preempt policy with no wait, each
    model's arrival stops the other between decode steps, evicting its weights. Its requests keep
    their caches and resume as decodes: no token is computed again by a prefill (``prefill_tokens``
    counts the prompts only). With less room some paused caches are given up (they recompute);
    with ``preempt_keeps_kv`` off all are. Tokens, greedy and seeded, equal undisturbed runs, and
    after every step the scheduler books the bytes the executor holds."""
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)]
    jobs = [("tiny-opt", list(range(5 + i, 25 + i)), sp) for i, sp in enumerate(params)] + \
           [("tiny-llama", list(range(7 + i, 19 + i)), sp) for i, sp in enumerate(params)]
    ref = make_engine(64 * 2**20, models=["tiny-opt", "tiny-llama"])
    want = [ref.generate(m, p, sp).output_ids for m, p, sp in jobs]
    eng = make_engine(budget, models=["tiny-opt", "tiny-llama"], policy="preempt", max_wait_s=0.0,
                      preempt_keeps_kv=keeps, executor=executor)
    try:
        reqs = [eng.submit(*job) for job in jobs[:2]]
        for _ in range(3):  # tiny-opt's requests are decoding when tiny-llama's arrive
            eng.step()
        reqs += [eng.submit(*job) for job in jobs[2:]]
        while not all(r.done for r in reqs):
            eng.step()
            mem = eng.memory()["devices"][0]  # the scheduler books what the executor holds, paused caches too
            assert mem["kv"] + mem["weights"] == mem["scheduled"]
        assert [r.output_ids for r in reqs] == want
        prompts = sum(len(p) for _, p, _ in jobs)
        if budget == 950_000 and keeps:
            assert eng.stats["pauses"] > 10 and eng.stats["preemptions"] == 0
            assert eng.stats["prefill_tokens"] == prompts
        elif keeps:
            assert eng.stats["pauses"] > 0 and eng.stats["preemptions"] > 0
            assert eng.stats["prefill_tokens"] > prompts
        else:
            assert eng.stats["pauses"] == 0 and eng.stats["preemptions"] > 10
            assert eng.stats["prefill_tokens"] > prompts
        assert eng.memory()["kv"] == 0
    finally:
        eng.executor.shutdown()


@pytest.mark.parametrize("executor", ["inprocess", "workers"])
def test_models_sharing_a_step_give_the_tokens_of_one_model_a_step(executor):
    """models_per_step 3: the three resident models' batches run in the same steps (fewer steps),
    each sequence's tokens those of an engine that steps one model at a time."""
    jobs = [(MODELS[i % 3], PROMPTS[i % len(PROMPTS)]) for i in range(9)]
    out, steps, shared = {}, {}, {}
    for per_step in (1, 3):
        eng = make_engine(64 * 2**20, models_per_step=per_step, executor=executor)
        try:
            for m in MODELS:
                eng.load(m, wait=True)
            before = eng.stats["steps"]
            reqs = [eng.submit(m, p, GREEDY) for m, p in jobs]
            eng.run_until_done(reqs)
            out[per_step], steps[per_step] = [r.output_ids for r in reqs], eng.stats["steps"] - before
            shared[per_step] = eng.stats["shared_steps"]
        finally:
            eng.executor.shutdown()
    assert out[3] == out[1]
    assert steps[1] == 3 * GREEDY.max_tokens and steps[3] == GREEDY.max_tokens
    assert shared == {1: 0, 3: GREEDY.max_tokens}  # every step ran all three models' batches
    with pytest.raises(ValueError, match="models_per_step must be an integer of at least 1, got 0"):
        EngineConfig(models_per_step=0)
