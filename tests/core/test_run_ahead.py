"""The run-ahead (``engine/ahead.py``) on the CPU, with real worker processes and in process: a worker
starts the next decode step of a steady batch before the engine asks for it. Tokens equal the
in-process executor's, greedy and seeded, while the batch changes under it (a request ends by
length, one joins, one is aborted, a model is stopped for another and resumed); the step run ahead
is really used (its counter), dropped when the next step differs, leaves no KV block behind, is
skipped for sharded models, and a worker killed while one is under way is handled as before. The
in-process executor with the run-ahead (a CUDA GPU's, here in the GPU's order on the CPU) gives
the same tokens, and every call between steps drops the step run ahead."""

import os
import signal

import pytest
import torch

from computron.config import EngineConfig, ModelSpec
from computron.engine import Engine, SamplingParams
from computron.engine.ahead import RunAheadExecutor

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PARAMS = {
    "a": GREEDY,
    "b": SamplingParams(max_tokens=12, temperature=1.0, top_k=40, seed=3, ignore_eos=True),  # ends by length
    "c": SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),  # aborted
    "d": SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True),  # joins
    "e": SamplingParams(max_tokens=10, temperature=1.1, seed=1, ignore_eos=True),  # joins later
}
PROMPTS = {"a": "hello", "b": "the quick brown fox", "c": "swap me in", "d": "1 2 3", "e": "Ünïcödé ✓"}


def make(executor: str, budget=64 * 2**20, models=("tiny-llama",), clock=None, **kw) -> Engine:
    cfg = EngineConfig(device="cpu", executor=executor, gpu_memory_budget=budget, workspace_bytes=50_000, **kw)
    eng = Engine(cfg, clock=clock) if clock is not None else Engine(cfg)
    for m in models:
        eng.register_model(m)
    return eng


def ahead_stats(eng: Engine) -> tuple[int, int]:
    st = eng.executor.status().stats  # a call between steps: it drops a step run ahead, if any
    return st["run_ahead_used"], st["run_ahead_dropped"]


def changing_batch(eng: Engine) -> dict[str, list[int]]:
    """A steady batch that changes under the run-ahead: b ends by length, d joins at step 5, c is
    aborted at step 9, e joins at step 15. Each engine gets them at the same steps."""
    reqs = {k: eng.submit("tiny-llama", PROMPTS[k], PARAMS[k]) for k in "abc"}
    for step in range(200):
        if step == 5:
            reqs["d"] = eng.submit("tiny-llama", PROMPTS["d"], PARAMS["d"])
        if step == 9:
            eng.abort(reqs["c"].id)
        if step == 15:
            reqs["e"] = eng.submit("tiny-llama", PROMPTS["e"], PARAMS["e"])
        if all(r.done for r in reqs.values()) and step > 15:
            break
        eng.step()
    assert [reqs[k].finish_reason for k in "abcde"] == ["length", "length", "abort", "length", "length"]
    assert len(reqs["c"].output_ids) == 9 and len(reqs["a"].output_ids) == 40
    assert eng.memory()["kv"] == 0  # blocks taken for steps run ahead were all given back
    return {k: r.output_ids for k, r in reqs.items()}


def test_tokens_equal_in_process_while_the_batch_changes():
    want = changing_batch(make("inprocess"))
    eng = make("workers")
    try:
        assert changing_batch(eng) == want
        used, dropped = ahead_stats(eng)
    finally:
        eng.executor.shutdown()
    # Dropped: when d joined, when c was aborted (its free), when e joined. Used: nearly every
    # other decode step.
    assert dropped == 3 and used >= 30


class WorkerLike(RunAheadExecutor):
    """The run-ahead executor in this process, driven as the worker loop drives it: the next step run
    ahead after each step's answer (on the CPU), anything else dropping it first."""

    def execute(self, batches):
        fut = super().execute(batches)
        self.run_ahead()
        return fut

    def free(self, req_ids):
        self.drop_ahead()
        super().free(req_ids)

    def apply(self, change):
        self.drop_ahead()
        return super().apply(change)

    def status(self):
        self.drop_ahead()
        return super().status()


@pytest.mark.parametrize("eager", [False, True])
def test_both_orders_give_the_in_process_tokens(eager):
    """``eager`` is a GPU's order (the step after next queued before the next one's tokens are read),
    here on the CPU, where queuing a step computes it."""
    cfg = EngineConfig(device="cpu", gpu_memory_budget=64 * 2**20, workspace_bytes=50_000)
    ex = WorkerLike(cfg)
    ex.eager = eager
    eng = Engine(cfg, executor=ex)
    eng.register_model("tiny-llama")
    assert changing_batch(eng) == changing_batch(make("inprocess"))
    assert ex.dropped == 3 and ex.used >= 30


def _stop_and_resume(eng, t) -> list[list[int]]:
    """Two tiny-llama requests decode 4 steps, then a tiny-opt request stops them (their caches kept,
    the model evicted) and they resume; every request ends without error, no KV left. Their tokens."""
    first = [eng.submit("tiny-llama", PROMPTS[k], PARAMS[k]) for k in "ab"]
    for _ in range(4):
        eng.step()
        t[0] += 0.05
    other = eng.submit("tiny-opt", PROMPTS["d"], PARAMS["d"])
    for _ in range(400):
        if all(r.done for r in first + [other]):
            break
        eng.step()
        t[0] += 0.05
    assert [r.error for r in first + [other]] == [None] * 3
    assert eng.stats["pauses"] >= 1 and eng.stats["evictions"] >= 2
    assert eng.memory()["kv"] == 0
    return [r.output_ids for r in first + [other]]


def test_a_model_stopped_and_resumed_between_steps_gives_the_same_tokens():
    """The preempt policy stops a steady batch for another model's request (evicting its weights, its
    requests paused with their caches) and resumes it later as decodes one token on: exactly the
    step that was run ahead before the eviction, which must not be used (it was dropped)."""
    t = [0.0]
    runs, ahead = [], None
    for executor in ("inprocess", "workers"):
        t[0] = 0.0
        eng = make(executor, budget=1_200_000, models=("tiny-llama", "tiny-opt"), clock=lambda: t[0],
                   policy="preempt", max_wait_s=0.2, preempt_keeps_kv=True)
        try:
            runs.append(_stop_and_resume(eng, t))
            if executor == "workers":
                ahead = ahead_stats(eng)
        finally:
            if executor == "workers":
                eng.executor.shutdown()
    assert runs[0] == runs[1]
    assert ahead[0] > 10 and ahead[1] >= 2


def test_a_worker_killed_while_a_step_runs_ahead_is_handled_as_before(alive):
    eng = make("workers", models=("tiny-llama", "tiny-opt"))
    try:
        want = make("inprocess").generate("tiny-llama", "after the crash", PARAMS["c"]).output_ids
        running = [eng.submit("tiny-llama", PROMPTS[k], PARAMS[k]) for k in "ac"]
        plans = [eng.core.step(1) for _ in range(6)]
        assert plans[-1].repeats  # the worker started the next step before answering this one's tokens
        pid = eng.executor.worker_pids()[0]
        os.kill(pid, signal.SIGKILL)
        eng.run_until_done(running, max_steps=50)
        for r in running:
            assert r.finish_reason == "error" and "worker for device 0 died (exit code -9)" in r.error
        assert eng.memory()["kv"] == 0 and not alive(pid)
        after = eng.generate("tiny-llama", "after the crash", PARAMS["c"])  # seeded: the fresh worker runs ahead
        assert after.error is None and after.output_ids == want
        st = eng.executor.status().stats
        assert st["restarts"] == 1 and st["run_ahead_used"] >= 30
    finally:
        eng.executor.shutdown()


def test_run_ahead_on_a_second_device_and_not_for_sharded_models():
    """Two workers (gloo): an unsharded model on device 1 runs ahead there; a model sharded over
    both (tp=2) never does (each rank would need the sampled token); tokens as in-process."""
    ref = make("inprocess", models=("tiny-gpt2", "tiny-opt"))
    jobs = [("tiny-gpt2", PROMPTS[k], PARAMS[k]) for k in "abd"]
    want = [[ref.generate(m, p, sp).output_ids for m, p, sp in jobs]]
    want.append(ref.generate("tiny-opt", PROMPTS["c"], PARAMS["c"]).output_ids)
    eng = Engine(EngineConfig(device="cpu", executor="workers", devices=2, gpu_memory_budget=64 * 2**20,
                              workspace_bytes=50_000))
    try:
        eng.register_model(ModelSpec("tiny-gpt2", devices=[1]))
        eng.register_model(ModelSpec("tiny-opt", tp=2))
        got = [eng.generate(m, p, sp).output_ids for m, p, sp in jobs]
        used, _ = ahead_stats(eng)
        assert got == want[0] and used >= 40
        assert eng.generate("tiny-opt", PROMPTS["c"], PARAMS["c"]).output_ids == want[1]
        assert ahead_stats(eng)[0] == used
    finally:
        eng.executor.shutdown()


def test_run_ahead_can_be_turned_off():
    eng = make("workers", run_ahead=False)
    try:
        r = eng.generate("tiny-llama", PROMPTS["a"], GREEDY)
        assert r.output_ids == make("inprocess").generate("tiny-llama", PROMPTS["a"], GREEDY).output_ids
        assert "run_ahead_used" not in eng.executor.status().stats
    finally:
        eng.executor.shutdown()


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2),
                                    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                   logit_bias={5: -100.0}),
                                    SamplingParams(max_tokens=20, temperature=0.9, seed=2, ignore_eos=True,
                                                   presence_penalty=0.5)])
def test_rows_that_need_the_host_between_steps_are_not_run_ahead(params):
    eng = make("workers")
    try:
        r = eng.generate("tiny-llama", PROMPTS["b"], params)
        assert r.output_ids == make("inprocess").generate("tiny-llama", PROMPTS["b"], params).output_ids
        assert ahead_stats(eng) == (0, 0)
    finally:
        eng.executor.shutdown()


# ---- the in-process executor with the run-ahead (``make_executor`` on a CUDA GPU) ------------------
# Driven by the engine's own thread: no ``run_ahead()`` after a step, every other call dropping the
# step run ahead itself. On the CPU ``eager`` (a GPU's order) is forced: queuing a step computes it.

def in_process_ahead(**kw) -> tuple[Engine, RunAheadExecutor]:
    cfg = EngineConfig(device="cpu", gpu_memory_budget=kw.pop("budget", 64 * 2**20), workspace_bytes=50_000, **kw)
    ex = RunAheadExecutor(cfg)
    ex.eager = True
    return Engine(cfg, executor=ex), ex


def test_in_process_run_ahead_gives_the_in_process_tokens_while_the_batch_changes():
    want = changing_batch(make("inprocess"))
    eng, ex = in_process_ahead()
    eng.register_model("tiny-llama")
    assert changing_batch(eng) == want  # greedy and seeded rows; an end by length, two joins, an abort
    # Dropped: when d joined, when c was aborted (its free), when e joined; used: nearly every other step.
    assert ex.dropped == 3 and ex.used >= 30
    assert ex.status().stats["run_ahead_used"] == ex.used
    # and the server's /metrics reads both counters from the executor
    from prometheus_client import generate_latest

    from computron.server.metrics import Metrics, engine_snapshot

    metrics = Metrics()
    metrics.update(engine_snapshot(eng))
    text = generate_latest(metrics.registry).decode()
    assert f"computron_run_ahead_used_total {float(ex.used)}" in text
    assert f"computron_run_ahead_dropped_total {float(ex.dropped)}" in text


def test_in_process_run_ahead_with_a_model_evicted_and_resumed_between_steps():
    """The preempt policy evicts the steady batch's model for another's request (its requests paused,
    caches kept) and resumes them as decodes one token on: the step run ahead before the eviction
    was dropped by the eviction (``apply``), never used."""
    t = [0.0]
    runs = []
    for ahead in (False, True):
        t[0] = 0.0
        cfg = EngineConfig(device="cpu", gpu_memory_budget=1_200_000, workspace_bytes=50_000, policy="preempt",
                           max_wait_s=0.2, preempt_keeps_kv=True)
        ex = None
        if ahead:
            ex = RunAheadExecutor(cfg)
            ex.eager = True
        eng = Engine(cfg, executor=ex, clock=lambda: t[0])
        for m in ("tiny-llama", "tiny-opt"):
            eng.register_model(m)
        runs.append(_stop_and_resume(eng, t))
    assert runs[0] == runs[1]
    assert ex.used > 10 and ex.dropped >= 2


def test_every_call_between_steps_drops_the_in_process_step_run_ahead():
    """Each protocol call but a step and a registration undoes a step run ahead before it acts: its KV
    blocks are back in the arena and a seeded generator draws as if it never ran."""
    from computron.messages import Residency

    eng, ex = in_process_ahead()
    eng.register_model("tiny-llama")
    kv_of = lambda: ex.arena.used("kv")  # noqa: E731 -- read without a protocol call (status drops)
    calls = {"status": lambda: ex.status(), "free": lambda: ex.free([]), "apply": lambda: ex.apply(Residency()),
             "wait_loads": lambda: ex.wait_loads(), "resize": lambda: ex.resize(0, ex.arena.nbytes),
             "probe_link": lambda: ex.probe_link("tiny-llama", 1)}
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=5, ignore_eos=True)
    want = make("inprocess").generate("tiny-llama", "a" * 15, params).output_ids
    req = eng.submit("tiny-llama", "a" * 15, params)  # its 16th and later tokens take a new block each 16
    for name, call in calls.items():
        for _ in range(3):
            eng.step()
        assert ex._ahead, name
        before, dropped = kv_of(), ex.dropped
        call()
        assert not ex._ahead and ex.dropped == dropped + 1, name
        assert kv_of() <= before, name
    eng.run_until_done([req], max_steps=200)
    assert req.output_ids == want and eng.memory()["kv"] == 0
    eng.submit("tiny-llama", "b", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert ex._ahead
    ex.unregister("not-a-model-here")  # a model not on the device: nothing dropped (another thread may call it)
    assert ex._ahead
    ex.shutdown()  # evicts the weights the step run ahead reads: dropped first
    assert not ex._ahead


def test_make_executor_runs_ahead_in_process_on_a_cuda_gpu_only(monkeypatch):
    import computron.engine.ahead as ahead
    import computron.engine.inprocess as inprocess
    import torch
    from computron.engine.executor import make_executor

    class Plain:
        def __init__(self, config):
            self.config = config

    class Ahead(Plain):
        pass

    monkeypatch.setattr(inprocess, "InProcessExecutor", Plain)
    monkeypatch.setattr(ahead, "RunAheadExecutor", Ahead)
    assert type(make_executor(EngineConfig(device="cpu"))) is Plain
    monkeypatch.setattr(inprocess, "pick_device", lambda d: torch.device("cuda" if d != "cpu" else "cpu"))
    assert type(make_executor(EngineConfig(device="cuda"))) is Ahead
    assert type(make_executor(EngineConfig(device="cuda", run_ahead=False))) is Plain
    assert type(make_executor(EngineConfig(device="cuda", executor="inprocess"))) is Ahead


# ---- several models a step (``models_per_step``): the step of all their batches runs ahead ---------

UNSEEDED = SamplingParams(max_tokens=30, temperature=0.7, ignore_eos=True)  # the default generator


def two_models(eng: Engine) -> dict[str, list[int]]:
    """tiny-llama and tiny-opt decode in the same steps; tiny-opt's b ends by length, d joins tiny-llama
    at step 6, c (tiny-opt) is aborted at step 10; d and f (one of each model) sample from the default
    generator, in turn. Each engine gets them at the same steps."""
    jobs = {"a": "tiny-llama", "b": "tiny-opt", "c": "tiny-opt", "d": "tiny-llama", "f": "tiny-opt"}
    params = {**PARAMS, "d": SamplingParams(max_tokens=25, temperature=0.9, ignore_eos=True), "f": UNSEEDED}
    reqs = {k: eng.submit(jobs[k], PROMPTS.get(k, "zz"), params[k]) for k in "abcf"}
    for step in range(200):
        if step == 6:
            reqs["d"] = eng.submit(jobs["d"], PROMPTS["d"], params["d"])
        if step == 10:
            eng.abort(reqs["c"].id)
        if all(r.done for r in reqs.values()) and step > 10:
            break
        eng.step()
    assert [reqs[k].finish_reason for k in "abcdf"] == ["length", "length", "abort", "length", "length"]
    assert eng.memory()["kv"] == 0  # blocks taken for steps run ahead were all given back
    return {k: r.output_ids for k, r in reqs.items()}


class Counting(WorkerLike):
    """Counts the steps of two batches answered by a step run ahead."""

    shared_used = 0

    def _step(self, batches):
        used = self.used
        result = super()._step(batches)
        self.shared_used += len(batches) > 1 and self.used > used
        return result


MODELS2 = ("tiny-llama", "tiny-opt")


def two_models_in_process() -> dict[str, list[int]]:
    """``two_models`` on the plain in-process executor, the default generator seeded as before each run."""
    torch.manual_seed(11)
    return two_models(make("inprocess", models=MODELS2, models_per_step=2))


def ahead_engine(ex: RunAheadExecutor, eager: bool) -> Engine:
    """An engine of ``CFG2`` over the run-ahead executor ``ex`` (``eager``: a GPU's order), both models registered,
    the default generator seeded as ``two_models_in_process`` seeds it."""
    ex.eager = eager
    eng = Engine(CFG2, executor=ex)
    for m in MODELS2:
        eng.register_model(m)
    torch.manual_seed(11)
    return eng


CFG2 = EngineConfig(device="cpu", gpu_memory_budget=64 * 2**20, workspace_bytes=50_000, models_per_step=2)


@pytest.mark.parametrize("eager", [False, True])
def test_a_step_of_two_models_runs_ahead_and_gives_the_in_process_tokens(eager):
    """Both models' batches in every step (``models_per_step`` 2): the step after is run ahead for
    both at once and used while neither batch changes. Greedy, seeded and unseeded rows give the
    in-process tokens, so a step run ahead and dropped sets every generator back."""
    want = two_models_in_process()
    ex = Counting(CFG2)
    eng = ahead_engine(ex, eager)
    assert two_models(eng) == want
    # Dropped: when d joined, when c was aborted (its free), when b ended (the plan of the step
    # where it made its last token expected no repeat, so nothing ran ahead there: not a drop).
    assert ex.dropped == 2 and eng.stats["shared_steps"] >= 28
    assert ex.shared_used >= 20  # most steps of both models were answered by a step run ahead


def test_a_step_of_two_models_runs_ahead_in_a_worker():
    want = two_models_in_process()
    eng = make("workers", models=MODELS2, models_per_step=2)
    try:
        got = two_models(eng)
        used, dropped = ahead_stats(eng)
    finally:
        eng.executor.shutdown()
    # d and f draw from the worker process's default generator, seeded apart from this one's
    assert {k: got[k] for k in "abc"} == {k: want[k] for k in "abc"}
    assert dropped == 2 and used >= 25


@pytest.mark.parametrize("how", ["cannot", "raises"])
def test_a_shared_step_runs_ahead_all_or_none(how):
    """When the second model's step cannot be run ahead (its blocks do not fit: None) or its launch
    raises, the first model's is undone at once (its blocks back, its generator as before) and the
    step itself is answered as usual: the tokens are still the in-process executor's."""
    want = two_models_in_process()
    ex = WorkerLike(CFG2)
    launch, failed = ex._launch, []

    def second_fails(b, first):
        if b.model == "tiny-opt":
            failed.append(b.model)
            if how == "raises":
                raise RuntimeError("no stream")
            return None
        return launch(b, first)

    ex._launch = second_fails
    step, partial = ex._step, []

    def checked(batches):  # never a run-ahead of some of a step's batches only
        result = step(batches)
        partial.append(bool(ex._ahead) and len(ex._ahead) != len(batches))
        return result

    ex._step = checked
    eng = ahead_engine(ex, eager=True)
    assert two_models(eng) == want
    assert failed and not any(partial) and ex.dropped == 0  # nothing run ahead, so nothing dropped
    assert eng.memory()["kv"] == 0


def test_metrics_expose_the_executors_decode_graph_captures():
    """Decode graphs are captured again when a model's weights move (a reload elsewhere, the arena
    compacted under colocation); /metrics says how many and how long, from the executor's counters
    (summed over workers), so a replay can tell what its swaps cost beyond the copies."""
    from dataclasses import replace as dc_replace

    from prometheus_client import generate_latest

    from computron.server.metrics import Metrics, engine_snapshot

    eng, ex = in_process_ahead()
    eng.register_model("tiny-llama")
    real = ex.status
    ex.status = lambda: dc_replace(real(), stats={**real().stats, "graph_captures": 5, "graph_capture_s": 0.25})
    metrics = Metrics()
    metrics.update(engine_snapshot(eng))
    text = generate_latest(metrics.registry).decode()
    assert "computron_graph_captures_total 5.0" in text
    assert "computron_graph_capture_seconds_total 0.25" in text
