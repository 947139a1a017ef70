"""Trace JSONL round-trips and errors; make_workload seeding and lengths; no torch."""

import io
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from computron.workload import (Fixed, Lengths, Pairs, Request, Trace, TraceFormatError, Uniform,
                                make_workload)


def test_jsonl_round_trip_is_exact(tmp_path):
    trace = make_workload(["a", "b", "c"], rate=7.0, duration=50.0, cv=3.0, skew=1.0,
                          prompt=(1, 4096), output=(0, 1000), seed=5)
    assert len(trace) > 100
    path = tmp_path / "t.jsonl"
    trace.write_jsonl(path)
    back = Trace.read_jsonl(path)
    assert back == trace
    assert [r.time for r in back] == [r.time for r in trace]  # bit-exact floats
    assert Trace.loads(trace.dumps()) == trace
    first = json.loads(path.read_text().splitlines()[0])
    assert list(first) == ["time", "model", "prompt_tokens", "output_tokens"]


def test_trace_sorts_and_reads_stream():
    t = Trace([Request(2.0, "a", 1, 1), Request(0.5, "b", 2, 3), Request(2.0, "c", 1, 1)])
    assert [r.model for r in t] == ["b", "a", "c"]
    text = '{"time": 1, "model": "x", "prompt_tokens": 3, "output_tokens": 4, "extra": 1}\n\n'
    assert Trace.read_jsonl(io.StringIO(text)).requests == [Request(1.0, "x", 3, 4)]


GOOD = '{"time": 0.5, "model": "a", "prompt_tokens": 10, "output_tokens": 2}'


@pytest.mark.parametrize("bad, message", [
    ('{"time": 0.5, "model": "a", "prompt_tokens": 10', "not valid JSON"),
    ('[1, 2, 3]', "expected a JSON object"),
    ('{"time": -1.0, "model": "a", "prompt_tokens": 10, "output_tokens": 2}', "time must be >= 0"),
    ('{"time": 1.0, "model": "a", "output_tokens": 2}', "missing field(s) prompt_tokens"),
    ('{"model": "a", "prompt_tokens": 1}', "missing field(s) time, output_tokens"),
    ('{"time": 1.0, "model": "", "prompt_tokens": 1, "output_tokens": 2}', "model must be"),
    ('{"time": 1.0, "model": "a", "prompt_tokens": 1.5, "output_tokens": 2}', "prompt_tokens must be an integer"),
    ('{"time": 1.0, "model": "a", "prompt_tokens": 1, "output_tokens": -2}', "output_tokens must be >= 0"),
    ('{"time": "soon", "model": "a", "prompt_tokens": 1, "output_tokens": 2}', "time must be a number"),
    ('{"time": NaN, "model": "a", "prompt_tokens": 1, "output_tokens": 2}', "time must be finite"),
])
def test_malformed_jsonl_names_the_line(tmp_path, bad, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([GOOD, "", GOOD, bad, GOOD]) + "\n")
    with pytest.raises(TraceFormatError) as e:
        Trace.read_jsonl(path)
    assert f"{path}:4:" in str(e.value)
    assert message in str(e.value)


def test_request_validates():
    with pytest.raises(ValueError, match="time must be >= 0"):
        Request(-0.1, "a", 1, 1)
    with pytest.raises(ValueError, match="prompt_tokens"):
        Request(0.0, "a", True, 1)


def test_same_seed_same_trace_other_seed_differs():
    kw = dict(models=["a", "b"], rate=5.0, duration=100.0, cv=2.0, skew=0.5, prompt=(8, 64),
              output=(1, 32))
    for process in ("gamma", "poisson", "bursts"):
        a = make_workload(**kw, seed=1, process=process)
        assert a == make_workload(**kw, seed=1, process=process)
        assert a != make_workload(**kw, seed=2, process=process)
    # a model's arrivals do not depend on the length settings
    a = make_workload(**kw, seed=1)
    b = make_workload(**{**kw, "prompt": 5}, seed=1)
    assert a.times() == b.times()


def test_the_start_flag_reaches_the_trace_and_arrival_keeps_the_traces_made_before():
    """``--start`` (loadgen and sim) picks how each Gamma stream starts; ``arrival`` gives the traces
    made before stationary streams were the default: cumulative Gamma gaps from 0."""
    import argparse

    from computron.workload.args import add_workload_args, workload_from_args

    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    flags = ["--rate", "4", "--cv", "2", "--duration", "30", "--seed", "5"]
    old = workload_from_args(ap.parse_args([*flags, "--start", "arrival"]), ["a", "b"])
    new = workload_from_args(ap.parse_args(flags), ["a", "b"])
    assert new == make_workload(["a", "b"], 4.0, 30.0, cv=2.0, seed=5, prompt=128, output=128)
    assert old == make_workload(["a", "b"], 4.0, 30.0, cv=2.0, seed=5, prompt=128, output=128, start="arrival")
    assert old.times() != new.times()
    first = np.random.SeedSequence(5).spawn(2)[0].spawn(2)[0]  # model a's arrival stream
    gaps = np.random.default_rng(first).gamma(0.25, 4 / 2.0, 3)
    np.testing.assert_allclose([r.time for r in old if r.model == "a"][:3], np.cumsum(gaps))
    with pytest.raises(ValueError, match="start must be one of"):
        make_workload(["a"], 1.0, 10.0, start="now")


def test_make_workload_lengths():
    t = make_workload(["m"], rate=50.0, duration=40.0, prompt=(10, 12), output=7, seed=0)
    p = np.array([r.prompt_tokens for r in t])
    assert set(p) == {10, 11, 12} and all(r.output_tokens == 7 for r in t)
    pairs = [(100, 1), (5, 500)]
    t = make_workload(["m"], rate=50.0, duration=40.0, lengths=Pairs(pairs), seed=0)
    seen = set((r.prompt_tokens, r.output_tokens) for r in t)
    assert seen == set(pairs)  # pairs stay together
    p, o = Lengths(Fixed(3), Uniform(0, 0)).sample(4, 0)
    assert list(p) == [3] * 4 and list(o) == [0] * 4
    with pytest.raises(ValueError):
        make_workload(["m"], rate=1.0, duration=1.0, process="weibull")
    with pytest.raises(ValueError):
        Uniform(5, 4)


def test_bursts_workload_mean_rate():
    t = make_workload(["m"], rate=4.0, duration=5000.0, process="bursts", on_s=1.0, off_s=1.0, seed=3)
    # long-run rate 4/s: count variance is inflated by the on/off switching; 10% is > 4 sigma here
    assert abs(len(t) / 5000.0 - 4.0) < 0.4


def test_imports_without_torch():
    code = textwrap.dedent("""
        import sys
        sys.modules['torch'] = None  # any 'import torch' now raises ImportError
        import computron.workload as w
        import computron.workload.arrivals, computron.workload.lengths, computron.workload.trace
        import computron.workload.importers, computron.workload.make
        t = w.make_workload(['a', 'b'], rate=5.0, duration=10.0, cv=2.0, skew=1.0, seed=0)
        assert w.Trace.loads(t.dumps()) == t
        assert all(not k.startswith('torch') or sys.modules[k] is None for k in sys.modules)
        print('ok')
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
