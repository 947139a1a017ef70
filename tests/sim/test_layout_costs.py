"""Model bytes from the config alone, the cost model, and calibration files."""

import json
from pathlib import Path

import pytest

from computron.models import PRESETS
from computron.sim import Calibration, VirtualClock, group_bytes, weight_bytes
from computron.sim.costs import batch_time, pipelined_finish


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_weight_bytes_match_the_real_layout_exactly(name):
    torch_layout = pytest.importorskip("computron.memory.layout")
    cfg = PRESETS[name]
    layout = torch_layout.layout_for(cfg)
    assert weight_bytes(cfg) == layout.nbytes
    assert group_bytes(cfg) == [hi - lo for lo, hi in layout.groups]


def test_weight_bytes_follow_dtype():
    cfg = PRESETS["opt-1.3b"]
    assert abs(weight_bytes(cfg.with_(dtype="float32")) - 2 * weight_bytes(cfg)) <= 512 * 8 * (cfg.num_layers + 2)


def test_costs_are_affine_with_a_weight_read_floor():
    cal = Calibration(hbm_bandwidth=1e9, prefill_fixed_s=0.01, prefill_token_s=0.001, prefill_token_s_per_byte=0,
                      decode_fixed_s=0.002, decode_seq_s=0.0005, decode_seq_s_per_byte=1e-12)
    nbytes = 10**6  # floor: 1 ms
    assert cal.prefill_time(nbytes, 10) == pytest.approx(0.01 + 10 * 0.001)
    assert cal.decode_time(nbytes, 4) == pytest.approx(0.002 + 4 * (0.0005 + 1e-6))
    assert cal.batch_time(nbytes, 10, 4) == pytest.approx(0.01 + 0.01 + 4 * (0.0005 + 1e-6))
    big = 10**8  # floor 0.1 s dominates
    assert cal.decode_time(big, 1) == pytest.approx(0.1)
    assert batch_time(cal, big, 0, 1) == cal.decode_time(big, 1)


def test_pipelined_finish():
    # two groups of equal bytes, compute 1 s total: group 0 lands at 2, group 1 at 4
    assert pipelined_finish(0.0, 1.0, [5, 5], [2.0, 4.0]) == pytest.approx(4.5)
    assert pipelined_finish(0.0, 10.0, [5, 5], [2.0, 4.0]) == pytest.approx(12.0)  # compute-bound
    assert pipelined_finish(5.0, 1.0, [5, 5], [2.0, 4.0]) == pytest.approx(6.0)  # already landed


def test_bandwidth_per_device():
    cal = Calibration(swap_bandwidth=(1e9, 2e9))
    assert cal.bandwidth(0) == 1e9 and cal.bandwidth(1) == 2e9 and cal.bandwidth(5) == 2e9
    assert Calibration(swap_bandwidth=3e9).swap_bandwidth == (3e9,)
    assert cal.load_time(2e9, 1) == pytest.approx(1.0)


def test_clock():
    c = VirtualClock()
    assert c() == c.now() == 0.0
    c.advance(1.5)
    c.advance_to(1.0)  # never backwards
    assert c.now() == 1.5
    c.advance_to(3.0)
    assert c() == 3.0
    with pytest.raises(ValueError):
        c.advance(-1)


def test_calibration_json_roundtrip(tmp_path):
    cal = Calibration(name="h200-ish", swap_bandwidth=(55e9, 54e9), hbm_bandwidth=4.2e12, evict_s=3e-5)
    p = tmp_path / "cal.json"
    cal.save(p)
    assert Calibration.load(p) == cal
    assert json.loads(p.read_text())["swap_bandwidth"] == [55e9, 54e9]


@pytest.mark.parametrize("text, match", [
    ("{not json", r"not valid JSON: .* line 1, column 2"),
    ("[1, 2]", r"expected a JSON object"),
    ('{"swap_bandwith": 1e9}', r"unknown field\(s\) swap_bandwith"),
    ('{"hbm_bandwidth": 0}', r"hbm_bandwidth must be positive"),
    ('{"evict_s": -1}', r"evict_s must be non-negative"),
    ('{"decode_fixed_s": "fast"}', r"decode_fixed_s must be a finite number"),
    ('{"swap_bandwidth": []}', r"swap_bandwidth must be a number or a non-empty list"),
    ('{"swap_bandwidth": [1e9, -2]}', r"swap_bandwidth must be positive"),
    ('{"device_memory": 1.5e9}', r"device_memory must be an integer"),
])
def test_bad_calibration_files_say_what_is_wrong(tmp_path, text, match):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        Calibration.load(p)
    assert str(p) in str(e.value)


def test_missing_calibration_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Calibration.load(tmp_path / "nope.json")


def test_calibration_without_server_seq_s_loads_as_zero(tmp_path):
    """Files written before the field existed (the committed H100 ones) load, with no server term."""
    old = json.loads((Path(__file__).parents[2] / "bench/results/sim_validate_h100/calibration_gpu_legacy.json")
                     .read_text())
    assert "server_seq_s" not in old
    p = tmp_path / "old.json"
    p.write_text(json.dumps(old))
    cal = Calibration.load(p)
    assert cal.server_seq_s == 0.0
    assert batch_time(cal, 10**9, 0, 8) == batch_time(Calibration(**{**old, "swap_bandwidth": tuple(old["swap_bandwidth"])}), 10**9, 0, 8)


def test_server_seq_s_is_charged_per_streaming_sequence():
    cal = Calibration(hbm_bandwidth=1e12, decode_fixed_s=1e-3, decode_seq_s=1e-4, decode_seq_s_per_byte=0.0,
                      prefill_fixed_s=2e-3, prefill_token_s=1e-5, prefill_token_s_per_byte=0.0, server_seq_s=2e-4)
    # decode of 16: 1 ms + 16 x 0.1 ms, then 16 x 0.2 ms of the server = 5.8 ms
    assert batch_time(cal, 10**9, 0, 16) == pytest.approx(1e-3 + 16e-4 + 16 * 2e-4)
    # the floor (1 GB / 1 TB/s = 1 ms) bounds the engine's part only: 1 seq -> max(1.1, 1) + 0.2 ms
    cal_f = Calibration(hbm_bandwidth=1e11, decode_fixed_s=1e-3, decode_seq_s=1e-4, decode_seq_s_per_byte=0.0,
                        server_seq_s=2e-4)
    assert batch_time(cal_f, 10**9, 0, 1) == pytest.approx(1e-2 + 2e-4)
    # mixed: 2 prompts of 100 tokens in all and 3 decodes: 2 ms + 1 ms + 0.3 ms + 5 x 0.2 ms
    assert batch_time(cal, 10**9, 100, 3, 2) == pytest.approx(2e-3 + 1e-3 + 3e-4 + 5 * 2e-4)
    assert batch_time(cal, 10**9, 100, 0) == pytest.approx(2e-3 + 1e-3 + 2e-4)  # one prompt when not told


def test_simulator_charges_server_seq_s():
    """A steady decode of 4 streams: each step is the hand-computed step plus 4 x server_seq_s."""
    from computron.config import EngineConfig
    from computron.sim import Simulation

    base = dict(hbm_bandwidth=1e15, prefill_fixed_s=1e-3, prefill_token_s=0.0, prefill_token_s_per_byte=0.0,
                decode_fixed_s=2e-3, decode_seq_s=1e-4, decode_seq_s_per_byte=0.0)
    tpot = {}
    for srv in (0.0, 5e-4):
        sim = Simulation(["tiny-opt"], Calibration(**base, server_seq_s=srv), EngineConfig(device="cpu"))
        res = sim.run([(0.0, "tiny-opt", 8, 11)] * 4)
        r = res.records[0]
        tpot[srv] = (r.finish - r.first_token) / 10
    assert tpot[0.0] == pytest.approx(2e-3 + 4 * 1e-4)
    assert tpot[5e-4] == pytest.approx(2e-3 + 4 * 1e-4 + 4 * 5e-4)


def test_simulator_charges_a_graph_capture_per_bucket_after_each_load():
    """The first decode step of each batch-size bucket after a load pays graph_capture_s (+ per byte):
    a lone request's TPOT carries one capture over its 10 decode steps; a model loaded again
    captures again; a batch of 3 runs in bucket 4, one capture more."""
    from computron.config import EngineConfig
    from computron.sim import Simulation

    base = dict(hbm_bandwidth=1e15, prefill_fixed_s=1e-3, prefill_token_s=0.0, prefill_token_s_per_byte=0.0,
                decode_fixed_s=2e-3, decode_seq_s=1e-4, decode_seq_s_per_byte=0.0)
    cfg = EngineConfig(device="cpu", gpu_memory_budget=2**20 + 1_000_000, workspace_bytes=2**20)  # one model at a time
    sim = Simulation(["tiny-opt=a", "tiny-opt=b"], Calibration(**base, graph_capture_s=5e-3), cfg)
    res = sim.run([(0.0, "a", 8, 11), (1.0, "b", 8, 11), (2.0, "a", 8, 11), (3.0, "a", 8, 11), (3.0, "a", 8, 11),
                   (3.0, "a", 8, 11)])
    tpot = [(r.finish - r.first_token) / 10 for r in res.records]
    for t in tpot[:3]:  # a, b, then a loaded again: each captures bucket 1
        assert t == pytest.approx(2.1e-3 + 5e-3 / 10)
    assert tpot[3] == pytest.approx(2e-3 + 3e-4 + 5e-3 / 10)  # three at once: bucket 4, captured once
    assert res.stats["swap_ins"] == 3 and sim.executor.stats["graph_captures"] == 4
    plain = Simulation(["tiny-opt=a"], Calibration(**base, graph_capture_s=5e-3),
                       EngineConfig(device="cpu", cuda_graphs=False)).run([(0.0, "a", 8, 11)])
    assert (plain.records[0].finish - plain.records[0].first_token) / 10 == pytest.approx(2.1e-3)  # no graphs
