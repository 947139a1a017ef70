"""The run-ahead on a CUDA GPU (the order the CPU tests cannot take for real: the step after next
queued on the device before the next one's tokens are read back, through CUDA graphs and eager
steps), in the workers and in process (the in-process executor's default on a GPU): tokens equal the
in-process executor's without it while the batch changes. Run on the lent GPU machine with
`pytest -m gpu tests/gpu`."""

import pytest
import torch

from computron.config import EngineConfig
from computron.engine import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PARAMS = {
    "a": SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    "b": SamplingParams(max_tokens=12, temperature=1.0, top_k=40, seed=3, ignore_eos=True),
    "c": SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
    "d": SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True),
    "e": SamplingParams(max_tokens=10, temperature=1.1, seed=1, ignore_eos=True),
}


def changing_batch(eng: Engine) -> dict[str, list[int]]:
    reqs = {k: eng.submit("tiny-llama", f"prompt {k}", PARAMS[k]) for k in "abc"}
    for step in range(200):
        if step == 5:
            reqs["d"] = eng.submit("tiny-llama", "prompt d", PARAMS["d"])
        if step == 9:
            eng.abort(reqs["c"].id)
        if step == 15:
            reqs["e"] = eng.submit("tiny-llama", "prompt e", PARAMS["e"])
        if all(r.done for r in reqs.values()) and step > 15:
            break
        eng.step()
    assert eng.memory()["kv"] == 0
    return {k: r.output_ids for k, r in reqs.items()}


def engine(executor: str, graphs: bool, run_ahead: bool = True) -> Engine:
    eng = Engine(EngineConfig(device="cuda", executor=executor, gpu_memory_budget=256 * 2**20,
                              workspace_bytes=64 * 2**20, cuda_graphs=graphs, run_ahead=run_ahead))
    eng.register_model("tiny-llama")
    return eng


@pytest.mark.parametrize("graphs", [True, False])
def test_run_ahead_on_gpu_gives_the_in_process_tokens(graphs):
    want = changing_batch(engine("inprocess", graphs, run_ahead=False))
    eng = engine("workers", graphs)
    try:
        assert changing_batch(eng) == want
        st = eng.executor.status().stats
        assert st["run_ahead_dropped"] == 3 and st["run_ahead_used"] >= 30
    finally:
        eng.executor.shutdown()


@pytest.mark.parametrize("graphs", [True, False])
def test_in_process_run_ahead_on_gpu_gives_the_in_process_tokens(graphs):
    from computron.engine.ahead import RunAheadExecutor
    from computron.engine.inprocess import InProcessExecutor

    plain = engine("inprocess", graphs, run_ahead=False)
    assert type(plain.executor) is InProcessExecutor
    want = changing_batch(plain)
    eng = engine("inprocess", graphs)
    assert isinstance(eng.executor, RunAheadExecutor) and eng.executor.eager
    assert changing_batch(eng) == want
    st = eng.executor.status().stats
    assert st["run_ahead_dropped"] == 3 and st["run_ahead_used"] >= 30
    eng.executor.shutdown()
