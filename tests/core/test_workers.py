"""The worker-process executor on the CPU with tiny models: same tokens as in-process, a killed
worker fails its requests at once and comes back, errors keep their message, nothing is left over."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future

import pytest

from computron.config import EngineConfig
from computron.engine import Engine, EngineError, SamplingParams
from computron.engine.executor import make_executor
from computron.messages import ModelDescription, Residency, StepResult

MODELS = ["tiny-opt", "tiny-llama", "tiny-gpt2"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello", "the quick brown fox", "swap me in", "1 2 3", "Ünïcödé ✓", "abc"]
ONE_FITS = 50_000 + 900_000  # one tiny model fits in the arena, two do not


def make_engine(budget, models=MODELS, **kw):
    eng = Engine(EngineConfig(device="cpu", gpu_memory_budget=budget, workspace_bytes=50_000, **kw))
    for m in models:
        eng.register_model(m)
    return eng


@pytest.fixture(scope="module")
def workers():
    eng = make_engine(ONE_FITS, executor="workers")
    yield eng
    eng.executor.shutdown()


def test_same_tokens_as_in_process_across_swaps(workers):
    ref = make_engine(ONE_FITS)
    seeded = [SamplingParams(max_tokens=6, temperature=1.2, top_k=40, seed=i, ignore_eos=True) for i in range(12)]
    jobs = [(MODELS[i % 3], PROMPTS[i % len(PROMPTS)], GREEDY if i % 2 else seeded[i]) for i in range(12)]
    runs = []
    for eng in (ref, workers):
        reqs = [eng.submit(m, p, sp) for m, p, sp in jobs]  # interleaved across models: swaps
        eng.run_until_done(reqs)
        assert all(r.error is None for r in reqs)
        runs.append([r.output_ids for r in reqs])
    assert runs[0] == runs[1]
    assert workers.stats["swap_ins"] >= 3 and workers.stats["evictions"] == workers.stats["swap_ins"] - 1
    assert workers.memory()["weights"] <= ONE_FITS and workers.memory()["kv"] == 0


def test_choices_of_a_prompt_and_its_log_probabilities_cross_the_pipe(workers):
    """n choices sharing their prompt's blocks in the worker, with the prompt's and the tokens'
    log-probabilities: what the in-process executor gives."""
    prompt = list(range(10, 50))
    params = [SamplingParams(max_tokens=5, temperature=1.0, seed=i, ignore_eos=True, logprobs=1, prompt_logprobs=2)
              for i in range(3)]
    runs = []
    for eng in (make_engine(ONE_FITS, models=["tiny-llama"]), workers):
        before = eng.stats["prefill_tokens"]
        reqs = eng.submit_choices("tiny-llama", prompt, params)
        eng.run_until_done(reqs)
        runs.append((eng.stats["prefill_tokens"] - before, [r.output_ids for r in reqs],
                     [[lp for lp, _ in r.logprobs] for r in reqs], reqs[0].prompt_logprobs))
        assert eng.memory()["kv"] == 0
    (n_a, out_a, lp_a, prompt_a), (n_b, out_b, lp_b, prompt_b) = runs
    assert n_a == n_b == 40 + 2 * 8 and out_a == out_b
    assert all(a == pytest.approx(b, abs=1e-5) for a, b in zip(lp_a, lp_b))
    assert prompt_a[0] is prompt_b[0] is None and len(prompt_b) == 40
    for (a, top_a), (b, top_b) in zip(prompt_a[1:], prompt_b[1:]):
        assert a == pytest.approx(b, abs=1e-5) and [i for i, _ in top_a] == [i for i, _ in top_b]


def test_worker_errors_keep_their_message(workers, tmp_path):
    with pytest.raises(EngineError, match=r"unknown model 'opt-99b': neither a checkpoint directory nor a preset"):
        workers.register_model("opt-99b")
    with pytest.raises(EngineError, match=r"opt-350m. needs 631.71 MiB of weights, more than the 878.50 KiB"):
        workers.register_model("opt-350m")
    with pytest.raises(EngineError, match="already registered"):
        workers.register_model("tiny-opt")
    with pytest.raises(KeyError, match="nope"):
        workers.executor.apply(Residency(load=["nope"]))
    from computron.models import CheckpointError

    with pytest.raises(CheckpointError, match="has no config.json"):  # the project's own type, not a look-alike
        workers.register_model(str(tmp_path))
    progress = []
    workers.executor.register(ModelDescription("extra", "tiny-gpt2"), progress.append)  # interim messages
    workers.executor.unregister("extra")
    assert progress and "building host image of extra" in progress[0]
    assert workers.generate("tiny-opt", "hi", GREEDY).finish_reason == "length"


def test_killed_worker_fails_its_requests_and_comes_back(alive):
    eng = make_engine(64 * 2**20, models=["tiny-opt", "tiny-llama"], executor="workers")
    try:
        ref = make_engine(64 * 2**20, models=["tiny-opt", "tiny-llama"])
        want = ref.generate("tiny-opt", "after the crash", GREEDY).output_ids
        want_queued = ref.generate("tiny-llama", "queued", GREEDY).output_ids
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        running = [eng.submit("tiny-opt", p, long) for p in PROMPTS[:3]]
        eng.step(), eng.step()
        waiting = eng.submit("tiny-llama", "queued", GREEDY)  # another model on the same device
        pid = eng.executor.worker_pids()[0]
        os.kill(pid, signal.SIGKILL)
        t0 = time.perf_counter()
        eng.run_until_done(running, max_steps=50)
        assert time.perf_counter() - t0 < 2.0
        for r in running:  # noticed in the step's execute, or in its swap (a prefetch of tiny-llama)
            assert r.finish_reason == "error" and "worker for device 0 died (exit code -9)" in r.error
        # A request that had not started did not need the dead worker: it waits for the new one.
        eng.run_until_done([waiting])
        assert waiting.error is None and waiting.output_ids == want_queued
        assert eng.model_state("tiny-opt") == "offloaded" and eng.model_state("tiny-llama") == "resident"
        assert eng.memory()["kv"] == 0
        after = eng.generate("tiny-opt", "after the crash", GREEDY)
        assert after.error is None and after.output_ids == want
        assert eng.executor.status().stats["restarts"] == 1 and not alive(pid)
        # A death between steps, with nothing running: the next request did not need the dead
        # worker; the next step learns the model is gone and it is served by the new worker.
        os.kill(eng.executor.worker_pids()[0], signal.SIGKILL)
        time.sleep(0.2)
        fresh = eng.generate("tiny-opt", "after the crash", GREEDY)
        assert fresh.error is None and fresh.output_ids == want
        assert eng.executor.status().stats["restarts"] == 2
    finally:
        pids = list(eng.executor.worker_pids().values())
        eng.executor.shutdown()
    assert not any(alive(p) for p in pids)


def test_parent_death_ends_the_worker(alive):
    code = textwrap.dedent("""
        import os, sys
        from computron.config import EngineConfig
        from computron.engine.executor import make_executor
        if __name__ == "__main__":
            ex = make_executor(EngineConfig(device="cpu", gpu_memory_budget=1_000_000, workspace_bytes=50_000,
                                            executor="workers"))
            print(ex.worker_pids()[0], flush=True)
            os._exit(0)  # no shutdown: the worker must see EOF and leave
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    deadline = time.time() + 10
    while alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(pid)


class LosesDevice:
    """An in-process executor whose next step says device 0 was lost (everything on it gone)."""

    def __init__(self, inner):
        self.inner, self.lose = inner, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, batches):
        if not self.lose:
            return self.inner.execute(batches)
        self.lose = False
        self.inner.free([s.req_id for b in batches for s in b.seqs])
        self.inner.apply(Residency(evict=list(self.inner.status().models)))
        fut = Future()
        fut.set_result(StepResult(failed={s.req_id: "the card caught fire" for b in batches for s in b.seqs},
                                  lost_devices=[0]))
        return fut


def test_core_lost_devices_offload_models_and_keep_the_executors_reason():
    cfg = EngineConfig(device="cpu", gpu_memory_budget=64 * 2**20, workspace_bytes=50_000)
    ex = LosesDevice(make_executor(cfg))
    eng = Engine(cfg, executor=ex)
    for m in ("tiny-opt", "tiny-llama"):
        eng.register_model(m)
    want = eng.generate("tiny-opt", "abc", GREEDY).output_ids
    eng.load("tiny-llama", wait=True)  # resident, no work: must be offloaded too
    r = eng.submit("tiny-opt", "abc", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    eng.step()
    ex.lose = True
    eng.step()
    assert r.finish_reason == "error" and r.error == "the card caught fire"
    assert eng.model_state("tiny-opt") == "offloaded" and eng.model_state("tiny-llama") == "offloaded"
    assert eng.memory()["devices"][0]["scheduled"] == 0
    assert eng.generate("tiny-opt", "abc", GREEDY).output_ids == want


class ResetsDevice(LosesDevice):
    """Its next step runs, then says device 0 was reset (a restarted world): the step's tokens came
    back, but the caches they were written into are gone."""

    def execute(self, batches):
        if not self.lose:
            return self.inner.execute(batches)
        self.lose = False
        result = self.inner.execute(batches).result()
        self.inner.free([s.req_id for b in batches for s in b.seqs])
        self.inner.apply(Residency(evict=list(self.inner.status().models)))
        result.reset_devices = [0]
        fut = Future()
        fut.set_result(result)
        return fut


def test_core_reset_devices_requeue_and_drop_the_steps_tokens():
    """A request on a reset device is not failed: it waits again and recomputes; the token the lost
    step made is dropped (its cache went with the device), so the output equals an undisturbed run."""
    cfg = EngineConfig(device="cpu", gpu_memory_budget=64 * 2**20, workspace_bytes=50_000)
    ex = ResetsDevice(make_executor(cfg))
    eng = Engine(cfg, executor=ex)
    eng.register_model("tiny-opt")
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    want = eng.generate("tiny-opt", "abc", long).output_ids
    r = eng.submit("tiny-opt", "abc", long)
    eng.step(), eng.step()
    made = len(r.output_ids)
    ex.lose = True
    eng.step()
    assert len(r.output_ids) == made and eng.model_state("tiny-opt") == "offloaded"
    eng.run_until_done([r])
    assert r.error is None and r.output_ids == want
    assert eng.core.stats["preemptions"] == 1


def test_shutdown_leaves_no_child(workers, alive):  # last: it stops the module's engine
    pid = workers.executor.worker_pids()[0]
    workers.executor.shutdown()
    workers.executor.shutdown()  # twice is fine
    assert not mp.active_children() and not alive(pid)


def test_a_sharded_models_load_is_reported_as_its_slowest_ranks():
    """Every rank of a step reports its own copies' time; the model's load took the slowest one's,
    whichever rank answers the tokens (here the fast one)."""
    import threading

    from computron.engine.workers import WorkerExecutor
    from computron.messages import ExecuteBatch, ModelDescription, Placement, StepResult
    from computron.parallel.dims import ParallelDims

    class Rank:
        def __init__(self, device, seconds):
            self.device, self.seconds = device, seconds

        def start_step(self, batches):
            self.batches = batches

        def finish_step(self, timeout):
            tokens = {"r": 7} if self.device == 0 else {}
            return StepResult(tokens=tokens, loaded={"m": self.seconds}, compute_s={"m": 0.01})

    ex = WorkerExecutor.__new__(WorkerExecutor)
    ranks = {0: Rank(0, 0.10), 1: Rank(1, 0.25)}
    ex._lock, ex._dead, ex._reset, ex.devices, ex.call_timeout = threading.Lock(), set(), set(), [0, 1], 5.0
    ex._descs = {"m": ModelDescription("m", "tiny-opt", None, 0, Placement(ParallelDims(tp=2), (0, 1)))}
    ex._worker = ranks.__getitem__
    ex.rank_loads = {}
    result = ex._step([ExecuteBatch("m", [])])
    assert result.loaded == {"m": 0.25} and result.tokens == {"r": 7}
    assert ex.rank_loads == {"m": {0: 0.10, 1: 0.25}}  # each rank's own, for benches that tell them apart


def test_device_0s_worker_which_hosts_the_store_stops_last(alive):
    """Device 0's worker hosts the process group's store: the others stop first, so none is left with
    a watchdog polling a store that has gone (NCCL prints a burst of broken-pipe warnings then)."""
    eng = Engine(EngineConfig(device="cpu", executor="workers", devices=3, gpu_memory_budget=2**24,
                              workspace_bytes=50_000))
    ex = eng.executor
    pids = ex.worker_pids()
    order = []
    for d, w in ex._workers.items():
        stop = w.stop

        def recorded(*a, d=d, stop=stop, **kw):
            stop(*a, **kw)
            order.append((d, [dev for dev, pid in pids.items() if alive(pid)]))
        w.stop = recorded
    ex.shutdown()
    assert order == [(2, [0, 1]), (1, [0]), (0, [])]  # each gone when its stop returns, device 0's last
