"""Striped swap-in under the worker executor, on the CPU: three worker processes joined by gloo stand
for three GPUs. A model on one device loads through one or two helper workers (chunks relayed from
the shared host image over point-to-point sends) byte for byte as its image, the engine's tokens are
those of a plain engine, the helpers' staging goes back, and bad combinations are refused clearly."""

import os

import pytest

from computron.config import EngineConfig, ModelSpec
from computron.engine import Engine, EngineError, SamplingParams
from computron.engine.workers import WorkerExecutor
from computron.messages import ModelDescription, Placement, Residency

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MODELS = ("tiny-opt", "tiny-llama", "tiny-gpt2")
CHUNK = 4096  # tiny images (~0.6 MB): many chunks per link, so the slots are reused


def _config(**kw):
    return EngineConfig(device="cpu", executor="workers", devices=3, gpu_memory_budget=50_000 + 900_000,
                        workspace_bytes=50_000, stripe_devices=[1, 2], stripe_chunk_bytes=CHUNK, **kw)


@pytest.fixture(scope="module")
def executor():
    ex = WorkerExecutor(_config())
    yield ex
    ex.shutdown()


def _staging(ex) -> int:
    return ex.status().stats["stripe_staging_bytes"]


def test_a_striped_load_lands_the_image_byte_for_byte_through_one_or_two_helpers(executor):
    ex = executor
    ex.register(ModelDescription("m", "tiny-llama", seed=3, placement=Placement(devices=(0,))))
    ex.register(ModelDescription("n", "tiny-opt", seed=4, placement=Placement(devices=(1,))))
    ex.register(ModelDescription("tp", "tiny-opt", placement=Placement(ModelSpec("tiny-opt", tp=2).placement().dims,
                                                                        (1, 2))))
    try:
        want = ex.image_digest("m")
        ex.apply(Residency(load=["m"]))
        assert ex.weights_digest("m") == want  # the plain load, for reference
        for helpers in ((1, 2), (2,), (2, 1)):
            ex.apply(Residency(evict=["m"]))
            ex.apply(Residency(load=["m"], stripes={"m": helpers}))
            assert ex.weights_digest("m") == want, helpers
            assert _staging(ex) == 0  # each helper's staging went back once its last send ended
        # a helper loading a model of its own in the same change, while it relays another's chunks
        ex.apply(Residency(evict=["m"]))
        ex.apply(Residency(load=["m", "n"], stripes={"m": (1, 2), "n": (2,)}))
        assert ex.weights_digest("m") == want and ex.weights_digest("n") == ex.image_digest("n")
        with pytest.raises(ValueError, match=r"devices \[0\] are not distinct stripe devices that may help device 1"):
            ex.apply(Residency(evict=["n"], load=["n"], stripes={"n": (0,)}))
        with pytest.raises(ValueError, match="only a model on one device is"):
            ex.apply(Residency(load=["tp"], stripes={"tp": (0,)}))
    finally:
        for name in ("m", "n", "tp"):
            ex.unregister(name)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"computron-{os.getpid()}-") and "-d0-" in f]


def test_engine_loading_through_helper_workers_gives_the_tokens_of_a_plain_engine(executor):
    plain = Engine(EngineConfig(device="cpu", gpu_memory_budget=50_000 + 900_000, workspace_bytes=50_000))
    eng = Engine(_config(), executor=executor)
    for m in MODELS:
        plain.register_model(m)
        eng.register_model(ModelSpec(m, devices=[0]))  # all on device 0: each request swaps its model in
    eng.register_model(ModelSpec("tiny-opt", alias="opt-on-1", devices=[1]))
    jobs = [(m, p) for p in ("hello", "swap me") for m in MODELS]
    want = [plain.generate(m, p, GREEDY).output_ids for m, p in jobs]
    assert [eng.generate(m, p, GREEDY).output_ids for m, p in jobs] == want
    assert eng.stats["swap_ins"] == len(jobs) and eng.stats["striped_swap_ins"] == len(jobs)
    # both devices load at once: device 1's model (the older request) borrows device 2's link; device 0's
    # then finds device 1 busy with its own load and device 2 lent, so it loads over its own link alone
    reqs = [eng.submit("opt-on-1", "hello", GREEDY), eng.submit("tiny-opt", "hello", GREEDY)]
    plan = eng.step()
    assert sorted(plan.loads) == ["opt-on-1", "tiny-opt"] and plan.stripes == {"opt-on-1": (2,)}
    eng.run_until_done(reqs)
    assert [r.output_ids for r in reqs] == [want[0], want[0]]
    assert eng.stats["striped_swap_ins"] == len(jobs) + 1
    sched = eng.core.scheduler
    assert sched.lent == {} and sched.staging_used == [0, 0, 0] and _staging(executor) == 0
    for m in (*MODELS, "opt-on-1"):
        eng.unregister_model(m)


def test_stripe_devices_under_workers_are_checked():
    with pytest.raises(EngineError, match=r"stripe_devices \[3\]: under workers a helper is one of the engine's 3"):
        Engine(EngineConfig(device="cpu", executor="workers", devices=3, stripe_devices=[1, 3]))
    with pytest.raises(EngineError, match="striped swap-ins need every worker on one node"):
        Engine(EngineConfig(device="cpu", executor="workers", devices=2, stripe_devices=[1],
                            workers_listen="127.0.0.1:0", local_devices=1))
    with pytest.raises(EngineError, match="this executor copies through one link \\(the legacy executor"):
        Engine(EngineConfig(device="cpu", executor="workers", policy="computron", devices=2, stripe_devices=[1]))
    with pytest.raises(ValueError, match="stripe_chunk_bytes must be a positive number of bytes"):
        EngineConfig(stripe_chunk_bytes=0)
