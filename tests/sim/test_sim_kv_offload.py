"""The simulator's side of caches moved to host memory and back: the copies take the device's copy
stream (bytes / swap bandwidth, behind loads), host bytes are accounted, and a model whose caches come
back computes once they have landed."""

import pytest

from computron.config import EngineConfig
from computron.messages import ExecuteBatch, ModelDescription, Residency, SamplingParams, SeqInput
from computron.sim import Calibration, VirtualClock
from computron.sim.executor import SimExecutor


def test_moves_are_charged_on_the_copy_stream_and_host_bytes_accounted():
    clock = VirtualClock()
    cal = Calibration(swap_bandwidth=(1e9,), prefill_fixed_s=1e-3, prefill_token_s=0.0, prefill_token_s_per_byte=0.0,
                      decode_fixed_s=1e-3, decode_seq_s=0.0, decode_seq_s_per_byte=0.0, hbm_bandwidth=1e18)
    ex = SimExecutor(EngineConfig(device="cpu", gpu_memory_budget=64 * 2**20), cal, clock)
    ex.register(ModelDescription("a", "tiny-opt"))
    ex.apply(Residency(load=["a"]))
    ex.wait_loads()
    p = SamplingParams(max_tokens=8)
    ex.execute([ExecuteBatch("a", [SeqInput("r", list(range(40)), 0, p)])]).result()  # 40 tokens: 3 blocks
    kv = ex.status().devices[0].kv
    assert kv > 0 and ex.host_bytes == 0
    t0 = max(clock.t, ex.link_free[0])
    ex.apply(Residency(kv_out=["r"], evict=["a"]))
    assert ex.status().devices[0].kv == 0 and ex.host_bytes == kv
    assert ex.link_free[0] == pytest.approx(t0 + kv / 1e9)
    ex.apply(Residency(load=["a"], kv_in=["r"]))
    assert ex.host_bytes == 0 and ex.status().devices[0].kv == kv
    ready = ex.link_free[0]  # the weights first, then the cache
    out = ex.execute([ExecuteBatch("a", [SeqInput("r", [1], 40, p)])]).result()
    assert "r" in out.tokens and clock.t >= ready
    assert ex.stats["kv_moved_bytes"] == 2 * kv
    ex.apply(Residency(kv_out=["r"]))
    ex.free(["r"])  # a cache in host memory goes with its request
    assert ex.host_bytes == 0 and ex.status().devices[0].kv == 0
