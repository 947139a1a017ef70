"""Model-parallel serving on the CPU: two worker processes joined by gloo stand for two GPUs.
Models sharded with tp=2 and pp=2 beside an unsharded one on the second device give the tokens
of a single-device engine, through swaps and through runs of several decode steps."""

import os
import signal
import time

from computron.config import EngineConfig, ModelSpec
from computron.engine import Engine, SamplingParams
from computron.messages import ExecuteBatch, Residency, SeqInput

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, top_k=40, seed=11, ignore_eos=True)


PROMPTS = ["hello", "the quick brown fox", "swap me in", "1 2 3", "Ünïcödé ✓", "abc"]


def test_sharded_models_on_two_workers_match_one_device_through_swaps():
    ref = Engine(EngineConfig(device="cpu", gpu_memory_budget=64 * 2**20, workspace_bytes=50_000))
    for m in ("tiny-opt", "tiny-llama", "tiny-gpt2"):
        ref.register_model(m)
    # Device 1 holds half of tiny-opt, the second stage of tiny-llama and all of tiny-gpt2 (~1.2 MB):
    # more than its 878 KiB arena, so requests swap there.
    eng = Engine(EngineConfig(device="cpu", executor="workers", devices=2, gpu_memory_budget=950_000,
                              workspace_bytes=50_000))
    try:
        eng.register_model(ModelSpec("tiny-opt", tp=2))
        eng.register_model(ModelSpec("tiny-llama", pp=2))
        eng.register_model(ModelSpec("tiny-gpt2", devices=[1]))
        info = eng.models["tiny-opt"].info
        assert info.placement.devices == (0, 1) and len(info.weight_bytes) == 2
        assert info.weight_bytes[0] < ref.models["tiny-opt"].nbytes * 0.7  # each rank holds about half
        assert eng.model_stats("tiny-llama")["parallel"] == {"dp": 1, "tp": 1, "pp": 2}
        jobs = [(m, p, sp) for i, p in enumerate(PROMPTS)
                for m, sp in [(("tiny-opt", "tiny-llama", "tiny-gpt2")[i % 3], GREEDY),
                              (("tiny-gpt2", "tiny-opt", "tiny-llama")[i % 3], SEEDED)]]
        want = [ref.generate(m, p, sp).output_ids for m, p, sp in jobs]
        reqs = [eng.submit(m, p, sp) for m, p, sp in jobs]  # interleaved across models and layouts
        eng.run_until_done(reqs)
        assert [r.error for r in reqs] == [None] * len(reqs)
        assert [r.output_ids for r in reqs] == want
        assert eng.stats["evictions"] >= 1 and eng.stats["swap_ins"] >= 3
        before = eng.stats["swap_ins"]
        for m, p, sp in jobs[:6]:  # one at a time, round robin: each needs memory another holds
            assert eng.generate(m, p, sp).output_ids == ref.generate(m, p, sp).output_ids
        assert eng.stats["swap_ins"] - before >= 4
        devices = eng.memory()["devices"]
        assert [d["device"] for d in devices] == ["cpu", "cpu"] and all(d["weights"] <= d["capacity"] for d in devices)
    finally:
        eng.executor.shutdown()


def test_runs_of_several_steps_give_the_tokens_of_single_steps():
    """A run of k decode steps in one execute (the worker of an unsharded model runs it itself; a
    sharded model's run is driven step by step from the parent) equals k single steps, greedy and
    seeded; through the engine core, runs of several steps give the single-step engine's tokens."""
    k = 5
    seeded = SamplingParams(max_tokens=64, temperature=1.0, top_k=40, seed=5, ignore_eos=True)
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    eng = Engine(EngineConfig(device="cpu", executor="workers", devices=2, gpu_memory_budget=64 * 2**20,
                              workspace_bytes=50_000))
    try:
        eng.register_model(ModelSpec("tiny-opt", tp=2))
        eng.register_model(ModelSpec("tiny-llama", pp=2, devices=[1, 0]))
        eng.register_model(ModelSpec("tiny-gpt2", devices=[1]))
        ex = eng.executor
        models = ["tiny-opt", "tiny-llama", "tiny-gpt2"]
        ex.apply(Residency(load=models))
        ex.wait_loads()
        prompts = [[5, 17, 42, 9], [300, 2, 77]]
        for m in models:
            runs = {}
            for how in ("run", "single"):
                seqs = [SeqInput(f"{m}-{how}-{i}", p, 0, sp) for i, (p, sp) in enumerate(zip(prompts, (greedy, seeded)))]
                first = ex.execute([ExecuteBatch(m, seqs)]).result().tokens
                seqs = [SeqInput(s.req_id, [first[s.req_id]], len(s.tokens), s.params) for s in seqs]
                if how == "run":
                    out = ex.execute([ExecuteBatch(m, seqs, steps=k)]).result()
                    runs[how] = [out.tokens[s.req_id] for s in seqs]
                    assert out.compute_s[m] > 0 and not out.failed
                else:
                    got = {s.req_id: [] for s in seqs}
                    for _ in range(k):
                        toks = ex.execute([ExecuteBatch(m, seqs)]).result().tokens
                        for s in seqs:
                            got[s.req_id].append(toks[s.req_id])
                        seqs = [SeqInput(s.req_id, [toks[s.req_id]], s.past + len(s.tokens), s.params) for s in seqs]
                    runs[how] = list(got.values())
                ex.free([s.req_id for s in seqs])
            assert all(len(r) == k for r in runs["run"]), runs
            assert runs["run"] == runs["single"], m
        ex.apply(Residency(evict=models))

        ref = Engine(EngineConfig(device="cpu", gpu_memory_budget=64 * 2**20, workspace_bytes=50_000))
        ref.register_model("tiny-opt")
        jobs = [(p, SamplingParams(max_tokens=12 + 3 * i, temperature=0.0 if i % 2 else 1.0, top_k=40, seed=i,
                                   ignore_eos=True)) for i, p in enumerate(PROMPTS[:4])]
        want = [ref.generate("tiny-opt", p, sp).output_ids for p, sp in jobs]
        reqs = [eng.submit("tiny-opt", p, sp) for p, sp in jobs]
        longest = 1
        while not all(r.done for r in reqs):
            longest = max(longest, eng.core.step(max_steps=8).steps)
        assert longest > 1  # runs of several steps went through the sharded model's workers
        assert [r.error for r in reqs] == [None] * len(reqs)
        assert [r.output_ids for r in reqs] == want
    finally:
        eng.executor.shutdown()


def test_killed_worker_restarts_the_world_and_its_models_work_again(alive):
    """SIGKILL of one of two workers while a tp=2 model decodes: its requests fail at once with the
    reason, every worker is restarted in a new process group, and afterwards the tp=2 model and a
    model on the other device give the tokens of a single-device engine. Then, with one model
    decoding on each device, the worker of device 1 is killed again: the requests on device 1 fail,
    while the request on device 0 needed only the surviving device, so it is not failed but
    recomputed on the new world and finishes with a single-device engine's tokens."""
    ref = Engine(EngineConfig(device="cpu", gpu_memory_budget=64 * 2**20, workspace_bytes=50_000))
    for m in ("tiny-opt", "tiny-gpt2", "tiny-llama"):
        ref.register_model(m)
    want = {m: ref.generate(m, "after the crash", GREEDY).output_ids for m in ("tiny-opt", "tiny-gpt2")}
    survivor_params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want_survivor = ref.generate("tiny-gpt2", PROMPTS[0], survivor_params).output_ids
    eng = Engine(EngineConfig(device="cpu", executor="workers", devices=2, gpu_memory_budget=64 * 2**20,
                              workspace_bytes=50_000))
    old = []
    try:
        eng.register_model(ModelSpec("tiny-opt", tp=2))
        eng.register_model(ModelSpec("tiny-gpt2", devices=[0]))
        eng.register_model(ModelSpec("tiny-llama", devices=[1]))
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        running = [eng.submit("tiny-opt", p, long) for p in PROMPTS[:3]]
        eng.step(), eng.step()
        old = list(eng.executor.worker_pids().values())
        os.kill(old[1], signal.SIGKILL)
        t0 = time.perf_counter()
        eng.run_until_done(running, max_steps=50)
        assert time.perf_counter() - t0 < 5.0
        for r in running:
            assert r.finish_reason == "error" and "worker for device 1 died (exit code -9)" in r.error, r.error
        for m in ("tiny-opt", "tiny-gpt2"):
            assert eng.model_state(m) == "offloaded"
            got = eng.generate(m, "after the crash", GREEDY)
            assert got.error is None and got.output_ids == want[m]
        assert eng.executor.status().stats["restarts"] == 1
        assert not any(alive(p) for p in old)
        new = list(eng.executor.worker_pids().values())
        assert len(new) == 2 and not set(new) & set(old)

        survivor = eng.submit("tiny-gpt2", PROMPTS[0], survivor_params)
        doomed = eng.submit("tiny-llama", PROMPTS[1], long)
        for _ in range(4):
            eng.step()
        assert survivor.output_ids and doomed.output_ids  # both were decoding when the worker died
        preempted = eng.core.stats["preemptions"]
        os.kill(new[1], signal.SIGKILL)
        eng.run_until_done([survivor, doomed], max_steps=200)
        assert doomed.finish_reason == "error" and "worker for device 1 died (exit code -9)" in doomed.error
        assert survivor.error is None and survivor.output_ids == want_survivor
        assert eng.core.stats["preemptions"] == preempted + 1
        assert eng.executor.status().stats["restarts"] == 2
    finally:
        eng.executor.shutdown()


def test_preset_larger_than_its_tokenizer_samples_the_same_ids_at_tp2():
    """A preset's vocabulary beyond its tokenizer's ids is masked off; sharded over the vocabulary
    (tp=2), the mask applies to the gathered logits, whole, so tokens equal the unsharded model's."""
    from computron.models.presets import PRESETS
    from computron.models.preset_tokenizer import token_ids

    ids = set(token_ids(PRESETS["opt-125m"]))
    assert len(ids) < PRESETS["opt-125m"].vocab_size  # the mask is in play
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 42, 9], [300, 2, 77, 40000, 8]]
    ref = Engine(EngineConfig(device="cpu", gpu_memory_budget=2**30, workspace_bytes=2**26))
    ref.register_model(ModelSpec("opt-125m", dtype="float32"))
    want = [ref.generate("opt-125m", p, params).output_ids for p in prompts]
    assert all(t in ids for w in want for t in w)
    eng = Engine(EngineConfig(device="cpu", executor="workers", devices=2, gpu_memory_budget=2**30,
                              workspace_bytes=2**26))
    try:
        eng.register_model(ModelSpec("opt-125m", dtype="float32", tp=2))
        got = [eng.generate("opt-125m", p, params) for p in prompts]
        assert [g.error for g in got] == [None, None]
        assert [g.output_ids for g in got] == want
    finally:
        eng.executor.shutdown()
