"""``bench/preempt_gpu_report.py``, which states the hot/cold mix's headline figures: the rate each
(policy, models a step) holds 99% to, interpolated between measured rates; runs of one rate averaged;
the models a step read from the folder; and each run simulated on its own trace (a simulation reused
only when made with the same calibration), with the ``computron`` policy left out without a
calibration of its executor."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from computron.workload import make_workload

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("preempt_gpu_report", ROOT / "bench" / "preempt_gpu_report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def test_the_rate_held_is_interpolated_where_attainment_falls_through_the_target():
    assert report.rate_at([(4, 1.0), (8, 0.996), (9, 0.96)], 0.99) == "8.2"  # 8 + (0.996 - 0.99) / 0.036
    assert report.rate_at([(9, 0.96), (8, 0.996)], 0.99) == "8.2"  # in any order
    assert report.rate_at([(4, 1.0), (5, 0.995)], 0.99) == ">5"
    assert report.rate_at([(4, 0.9), (5, 0.8)], 0.99) == "<4"
    assert report.rate_at([(3, 0.98), (4, 0.995)], 0.99) == "<3"  # under it first: no crossing above
    assert report.rate_at([], 0.99) == "-"


def test_runs_of_one_rate_are_averaged():
    rs = [{"policy": "default", "mps": 1, "rate": 7.0, "attained": 0.873},
          {"policy": "default", "mps": 1, "rate": 7.0, "attained": 0.924},
          {"policy": "default", "mps": 1, "rate": 5.0, "attained": 1.0},
          {"policy": "slo", "mps": 3, "rate": 8.0, "attained": 0.996}]
    got = report.curves(rs)
    assert got[("default", 1)] == [(5.0, 1.0), (7.0, pytest.approx(0.8985))]
    assert got[("slo", 3)] == [(8.0, 0.996)]


def _measured(path: Path, trace, attained: float) -> None:
    """A loadgen result as it writes one, cut to what the report reads."""
    recs = [{"model": a.model, "arrival": a.time, "first_token": a.time + 0.05, "finish": a.time + 0.3, "error": None}
            for a in trace]
    scales = list(range(1, 11))
    path.write_text(json.dumps({"summary": {
        "all": {"requests": len(recs), "failed": 0, "latency": {"mean": 0.4, "p99": 1.0}},
        "slo": {"scales": scales, "all": [attained] * len(scales), "base_s": {m: 0.1 for m in trace.models}}},
        "records": recs}))


def test_the_opening_of_a_trace_can_be_left_out_of_the_attainment():
    """Requests that arrived before ``after`` seconds do not count in ``attained_after``; a failed one and
    one later than the scale times its model's solo latency miss."""
    base = {"a": 0.1, "b": 0.2}
    recs = [{"model": "a", "arrival": 0.1, "finish": 2.0, "error": None},  # missed, in the opening
            {"model": "b", "arrival": 6.0, "finish": 6.9, "error": None},  # 0.9 s <= 5 x 0.2: met
            {"model": "a", "arrival": 7.0, "finish": 7.6, "error": None},  # 0.6 s > 5 x 0.1: missed
            {"model": "a", "arrival": 8.0, "finish": None, "error": "refused"},
            {"model": "b", "arrival": 9.0, "finish": 9.5, "error": None}]
    d = {"summary": {"slo": {"base_s": base}}, "records": recs}
    assert report._met_after(d, 5.0, 5.0) == 0.5
    assert report._met_after(d, 5.0, 0.0) == 0.4
    assert report._met_after(d, 5.0, 10.0) is None


def test_runs_are_found_by_folder_and_simulated_on_their_own_trace(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    shutil.copy(ROOT / "bench" / "results" / "preempt_gpu_h200_mps3" / "calibration_served_f036.json", cal)
    names = ["hot", "c1", "c2"]
    trace = make_workload(names, rate=None, rates=[2.0, 0.5, 0.5], duration=4, cv=2.0, prompt=(16, 32),
                          output=(4, 8), seed=3)
    for mps, policy, rate, att in [(1, "default", 3, 1.0), (3, "slo", 3, 1.0), (1, "computron", 3, 0.2)]:
        d = tmp_path / f"mps{mps}" / f"rate_{rate}"
        d.mkdir(parents=True, exist_ok=True)
        trace.write_jsonl(d / "trace.jsonl")
        _measured(d / f"measured_{policy}.json", trace, att)
    models = ",".join(f"tiny-opt={n}" for n in names)
    argv = [str(tmp_path), "--simulate", str(cal), "--models", models, "--budget", "64MiB", "--max-loaded", "2"]
    assert report.main(argv) == 0
    out = capsys.readouterr().out
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): line for line in out.splitlines()
            if line.startswith("| ") and "policy" not in line and "---" not in line}
    assert set(rows) == {("computron", "1", "3"), ("default", "1", "3"), ("slo", "3", "3")}
    assert "| - |" in rows[("computron", "1", "3")]  # no calibration of its executor: not simulated
    sims = {p.parent.parent.name + "/" + p.name for p in tmp_path.rglob("sim_*.json")}
    assert sims == {"mps1/sim_default.json", "mps3/sim_slo.json"}
    settings = json.loads(next((tmp_path / "mps3").rglob("sim_slo.json")).read_text())["settings"]
    assert (settings["models_per_step"], settings["policy"], settings["trace"], settings["loadgen_probes"]) == (
        3, "slo", str(tmp_path / "mps3" / "rate_3" / "trace.jsonl"), True)  # the probes first, as on the server
    # again with the same calibration: reused; with another: simulated again
    stamp = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("sim_*.json")}
    assert report.main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("sim_*.json")} == stamp
    other = tmp_path / "other.json"
    shutil.copy(cal, other)
    assert report.main([*argv[:2], str(other), *argv[3:]]) == 0
    assert all(p.stat().st_mtime_ns != stamp[p] for p in stamp)


def test_the_crossing_is_a_number_for_the_pooled_ratio():
    assert report.crossing([(4, 1.0), (8, 0.996), (9, 0.96)]) == pytest.approx(8 + 0.006 / 0.036)
    assert report.crossing([(3, 0.98), (4, 0.97)]) is None  # under 99% at the lowest rate
    assert report.crossing([(12, 0.991), (3, 1.0)]) == float("inf")  # never under it, in any order
    spec = importlib.util.spec_from_file_location("slo_seeds", ROOT / "bench" / "slo_seeds.py")
    seeds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seeds)
    assert seeds.seeds("1-4") == [1, 2, 3, 4] and seeds.seeds("7") == [7]
    assert seeds.crossing([(4, 1.0), (5, 0.98)]) == pytest.approx(4.5)  # the script pools with the report's
