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
from computron.workload.trace import Trace

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


def test_runs_of_one_rate_are_pooled_by_their_requests():
    """Traces of several seeds at one rate count as one long trace: 300 requests at 90% and 100 at 98%
    are 92% (not the runs' mean, 94%); the attainment after the opening weighs by the late requests."""
    rs = [{"policy": "default", "mps": 1, "rate": 7.0, "attained": 0.9, "requests": 300,
           "attained_after": 1.0, "late": 10},
          {"policy": "default", "mps": 1, "rate": 7.0, "attained": 0.98, "requests": 100,
           "attained_after": 0.5, "late": 30},
          {"policy": "default", "mps": 1, "rate": 5.0, "attained": 1.0, "requests": 50},
          {"policy": "slo", "mps": 3, "rate": 8.0, "attained": 0.996, "requests": 80}]
    got = report.curves(rs)
    assert got[("default", 1)] == [(5.0, 1.0), (7.0, pytest.approx(0.92))]
    assert got[("slo", 3)] == [(8.0, pytest.approx(0.996))]
    assert report.curves(rs, "attained_after") == {("default", 1): [(7.0, pytest.approx(0.625))]}


def test_the_runs_of_several_seeds_are_pooled_in_a_table(tmp_path, capsys):
    for seed, n, att in [(1, 3, 1.0), (2, 9, 0.9)]:
        trace = make_workload(["hot", "c1"], rate=None, rates=[2.0, 2.0], duration=20, cv=1.0, prompt=(16, 32),
                              output=(4, 8), seed=seed)
        d = tmp_path / f"seed{seed}" / "rate_4"
        d.mkdir(parents=True)
        _measured(d / "measured_default.json", Trace(trace.requests[:n]), att)
    assert report.main([str(tmp_path), "--after", "0"]) == 0
    out = capsys.readouterr().out
    assert "| default | 1 | 4 | 2 | 12 | 92.5% | 100.0% | - |" in out  # (3 x 1.0 + 9 x 0.9) / 12
    assert [line.split("|")[-2].strip() for line in out.splitlines() if "| 0.40 / 1.00 |" in line] == ["seed1", "seed2"]
    assert "default, 1 a step: 99% held to <4 req/s (after 0 s: >4)" in out
    with pytest.raises(SystemExit):
        report.main([str(tmp_path), "--by-context"])
    assert "--by-context compares measured requests with simulated ones" in capsys.readouterr().err


def _measured(path: Path, trace, attained: float) -> None:
    """A loadgen result as it writes one, cut to what the report reads."""
    recs = [{"model": a.model, "arrival": a.time, "first_token": a.time + 0.05, "finish": a.time + 0.3, "error": None,
             "prompt_tokens": a.prompt_tokens, "output_tokens": a.output_tokens} for a in trace]
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


def _slo_seeds():
    spec = importlib.util.spec_from_file_location("slo_seeds", ROOT / "bench" / "slo_seeds.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_simulated_seeds_pool_resample_and_merge(tmp_path, capsys):
    """Seeds pool by their requests (one drawn twice counts twice); the ratio of the slo policy's 99%
    rate to the default's; a bootstrap over one seed has no spread; files of other seeds merge into
    the same figures, and files of other settings or the same seed are refused."""
    seeds = _slo_seeds()
    cells = {"default@1": {4.0: {1: (100, 100), 2: (196, 200)}, 5.0: {1: (97, 100), 2: (190, 200)}},
             "slo@3": {8.0: {1: (100, 100), 2: (200, 200)}, 10.0: {1: (98, 100), 2: (190, 200)}}}
    assert seeds.points(cells["default@1"], [1, 2, 2]) == [(4.0, pytest.approx(492 / 500)),
                                                            (5.0, pytest.approx(477 / 500))]
    assert seeds.points(cells["default@1"], [1]) == [(4.0, 1.0), (5.0, 0.97)]
    # seed 1 alone: the default falls through 99% at 4 + 1/3, the slo policy at 8 + 2/2: 2.08x
    assert seeds.ratio(cells, [1]) == pytest.approx(9 / (4 + 1 / 3))
    assert seeds.ratio(cells, [2]) == float("inf")  # the default is under 99% already at 4 req/s
    one = seeds.bootstrap(cells, [1], 50)
    assert one["p5"] == one["p95"] == pytest.approx(9 / (4 + 1 / 3)) and one["share_at_least_2x"] == 1.0
    assert seeds.bootstrap(cells, [1, 2], 400)["share_at_least_2x"] == 1.0  # inf (seed 2 alone) counts as 2x
    settings = {"duration": 60.0, "start": "stationary", "calibration": "cal.json", "rates": "4,5,8,10"}

    def write(name, seed, **other):
        configs = {c: {"pooled": {str(r): {"met_by_seed": {str(seed): by[seed][0]},
                                           "requests_by_seed": {str(seed): by[seed][1]}} for r, by in rates.items()}}
                   for c, rates in cells.items()}
        (tmp_path / name).write_text(json.dumps({"settings": {**settings, **other}, "configs": configs}))
        return str(tmp_path / name)

    a, b = write("a.json", 1), write("b.json", 2)
    seeds.main(["--load", a, b, "--out", str(tmp_path / "ab.json"), "--bootstrap", "0"])
    got = json.loads((tmp_path / "ab.json").read_text())
    assert got["configs"]["default@1"]["pooled"]["4.0"]["attained"] == pytest.approx(296 / 300, abs=1e-5)
    assert got["configs"]["slo@3"]["rate_at_99"] == pytest.approx(8.5)  # 100% at 8, 288/300 = 96% at 10
    with pytest.raises(SystemExit, match="seed 1 is in two files"):
        seeds.main(["--load", a, a, "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="other settings"):
        seeds.main(["--load", a, write("c.json", 2, duration=200.0), "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="cannot read .*missing.json"):
        seeds.main(["--load", str(tmp_path / "missing.json"), "--out", str(tmp_path / "x.json")])
    (tmp_path / "other.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a file this script wrote"):
        seeds.main(["--load", str(tmp_path / "other.json"), "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit):
        seeds.main(["--load", a, "--bootstrap", "-1"])
    assert "--bootstrap takes a count" in capsys.readouterr().err


def test_the_simulated_latency_is_compared_request_by_request():
    """Each measured request against its simulated twin (same model and lengths, arrived within 50 ms):
    the mean gap in time to first token and in the rest; a request with two twins, none, or no first
    token is left out."""
    def rec(model, arrival, first, finish, prompt=10, output=5):
        return {"model": model, "arrival": arrival, "first_token": first, "finish": finish,
                "prompt_tokens": prompt, "output_tokens": output}
    measured = [rec("a", 1.01, 1.2, 2.0), rec("b", 2.02, 2.1, 2.5), rec("a", 5.0, 5.1, 5.2, prompt=7),
                rec("c", 7.0, None, None), rec("d", 9.0, 9.1, 9.2)]
    simulated = [rec("a", 1.0, 1.1, 1.8), rec("b", 2.0, 2.06, 2.4), rec("a", 5.0, 5.1, 5.2, prompt=7),
                 rec("a", 5.02, 5.1, 5.2, prompt=7), rec("c", 7.0, 7.1, 7.2), rec("d", 9.1, 9.1, 9.2)]
    pairs = report.twins(measured, simulated)
    assert [(r["model"], q["arrival"]) for r, q in pairs] == [("a", 1.0), ("b", 2.0)]
    first, rest = report.phase_gaps(pairs)
    assert first == pytest.approx((0.09 + 0.02) / 2) and rest == pytest.approx((0.1 + 0.06) / 2)
    assert report.phase_gaps(report.twins(measured[3:], simulated)) is None


def test_the_gap_per_token_is_binned_by_context():
    """(measured minus simulated decode time) / (output tokens - 1), binned by prompt + output / 2: 100
    and 20 tokens (context 110) 19 ms slower is +1 ms a token, 120 and 30 (135) 87 ms slower +3 ms, so
    +2 ms in the first bin; 400 and 40 (420) 78 ms slower, +2 ms in the third; 4 output tokens: left out."""
    def pair(prompt, output, gap):
        r = {"prompt_tokens": prompt, "output_tokens": output, "first_token": 1.0, "finish": 2.0 + gap}
        return r, {**r, "finish": 2.0}
    got = report.gap_by_context([pair(100, 20, 0.019), pair(400, 40, 0.078), pair(100, 4, 1.0),
                                 pair(120, 30, 0.029 * 3)])
    assert [(lo, hi, n) for lo, hi, n, _ in got] == [(0, 150, 2), (300, 450, 1)]
    assert [g for *_, g in got] == [pytest.approx(0.002), pytest.approx(0.002)]  # (1 + 3) / 2 ms; 78 / 39
