"""Latency, TPOT and SLO attainment from records, checked by hand; the sim's preset and sweep."""

import json
import math
from types import SimpleNamespace as R

import pytest

from computron.workload.report import attainment, by_model, tpot


def _r(model, arrival, first, finish, out=5, ok=True):
    return R(model=model, arrival=arrival, first_token=first, finish=finish, output_tokens=out, ok=ok)


def test_attainment_and_tpot_by_hand():
    recs = [_r("a", 0.0, 0.1, 0.5), _r("a", 1.0, 1.2, 2.0), _r("b", 0.0, 0.3, 3.0),
            _r("b", 0.0, 0.1, 0.2, ok=False)]  # failed quickly (an error mid-stream): a miss all the same
    slo = attainment(recs, {"a": 0.5, "b": 1.0}, scales=[1, 2, 4])
    assert slo["models"]["a"] == [0.5, 1.0, 1.0]  # latencies 1x and 2x the base
    assert slo["models"]["b"] == [0.0, 0.0, 0.5]  # 3x the base; the failed one never counts
    assert slo["all"] == [0.25, 0.5, 0.75]
    assert attainment(recs, 1.0, scales=[1])["all"] == [0.5]  # a fixed base in seconds
    assert attainment(recs, {"a": 0.5}, scales=[100])["models"]["b"] == [0.0]  # no base: missed
    assert tpot(recs[0]) == pytest.approx(0.4 / 4) and tpot(_r("a", 0, 1, 1, out=1)) is None
    s = by_model(recs)
    assert s["models"]["b"]["failed"] == 1 and s["all"]["completed"] == 3
    assert s["models"]["a"]["latency"]["mean"] == pytest.approx(0.75)
    assert math.isnan(by_model([])["all"]["latency"]["p99"])


def test_sim_preset_sweep_plots_every_policy(tmp_path):
    pytest.importorskip("matplotlib")
    from computron.cli import main

    out = tmp_path / "sweep.json"
    code = main(["sim", "--preset", "3m-10-1-1", "--calibration", "h200-rough", "--duration", "5", "--sweep", "rate",
                 "--values", "1,60", "--plots", str(tmp_path), "--out", str(out)])
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["policy"], r["rate"]) for r in runs] == [(p, v) for p in ("default", "preempt", "slo", "computron")
                                                      for v in ("1", "60")]
    for policy in ("default", "preempt", "slo", "computron"):
        low, high = (r["summary"]["slo"] for r in runs if r["policy"] == policy)
        at = low["scales"].index(5.0)
        assert low["all"][at] > high["all"][at]  # an overloaded server meets fewer SLOs
        assert "opt-13b-0" in low["base_s"] and set(low["base_s"]) <= {"opt-13b-0", "opt-13b-1", "opt-13b-2"}
    assert (tmp_path / "sweep_rate.png").stat().st_size > 1000
