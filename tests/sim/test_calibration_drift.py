"""``bench/calibration_drift.py``, which says whether the simulator's error on a served run is its
model's or its calibration's: each run simulated from its own call's calibration, another call's, and
a calibration from elsewhere taken apart group by group."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from computron.cli import main as cli
from computron.sim.costs import CPU_DEFAULT
from computron.workload import make_workload

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("calibration_drift", ROOT / "bench" / "calibration_drift.py")
drift = importlib.util.module_from_spec(spec)
spec.loader.exec_module(drift)
MODELS = "opt-125m=hot,opt-125m=c1"


def _call(root: Path, name: str, cal: dict, seed: int) -> Path:
    """A call folder whose one default-policy run is what the simulator makes of its trace from ``cal``:
    a 'measurement' the call's own calibration reproduces exactly."""
    d = root / name / f"seed{seed}" / "mps1" / "rate_4"
    d.mkdir(parents=True)
    (root / name / "calibration_served.json").write_text(json.dumps(cal))
    make_workload(["hot", "c1"], rate=None, rates=[3.0, 1.0], duration=8, cv=2.0, prompt=(16, 64),
                  output=(4, 16), seed=seed).write_jsonl(d / "trace.jsonl")
    assert cli(["sim", "--models", MODELS, "--trace", str(d / "trace.jsonl"), "--calibration",
                str(root / name / "calibration_served.json"), "--policy", "default", "--budget", "10.5GiB",
                "--max-loaded", "3", "--loadgen-probes", "--out", str(d / "measured_default.json")]) == 0
    return d


def test_the_group_that_differs_closes_the_gap_and_no_other_does(tmp_path, capsys):
    own = CPU_DEFAULT.to_dict() | {"hbm_bandwidth": 1e13, "decode_fixed_s": 2e-3}  # steps not paced by weight reads
    slow = dict(own, name="elsewhere", decode_fixed_s=3 * own["decode_fixed_s"])  # decode terms only differ
    _call(tmp_path, "call1", own, seed=1)
    _call(tmp_path, "call2", own | {"prefill_fixed_s": 2 * own["prefill_fixed_s"]}, seed=2)
    (tmp_path / "elsewhere.json").write_text(json.dumps(slow))
    out = tmp_path / "drift.json"
    assert drift.main([str(tmp_path), "--also", str(tmp_path / "elsewhere.json"), "--models", MODELS,
                       "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    by_run = {r["call"]: r for r in d["rows"]}
    for call, r in by_run.items():
        assert r["by_calibration"][call] == pytest.approx({"mean": 0, "p50": 0, "p99": 0}, abs=1e-9)
        assert r["by_calibration"]["elsewhere"]["mean"] > 0.05  # slower decode steps: later finishes
        mixed = r["first_also_with_own"]
        if call == "call1":  # only the decode terms differ: taking them from the own call closes the gap
            assert mixed["decode"] == pytest.approx({"mean": 0, "p50": 0, "p99": 0}, abs=1e-9)
        else:  # call2's prefills were slower too: its decode terms alone leave the simulation short
            assert mixed["decode"]["mean"] < 0
        for g in ("swap", "graphs", "shared"):  # equal terms: the gap as it was
            assert mixed[g] == pytest.approx(r["by_calibration"]["elsewhere"])
    assert by_run["call2"]["by_calibration"]["call1"]["mean"] < 0  # call2's runs had the slower prefills
    assert d["summary"]["own_call_worst_abs"] == pytest.approx(0, abs=1e-9)
    crossed = [abs(by_run[a]["by_calibration"][b][q]) for a, b in (("call1", "call2"), ("call2", "call1"))
               for q in ("mean", "p50", "p99")]
    assert sum(crossed) > 0 and d["summary"]["other_call_mean_abs"] == pytest.approx(sum(crossed) / 6)
    assert d["decode_ms"]["elsewhere"]["1"] > d["decode_ms"]["call1"]["1"]
    text = capsys.readouterr().out
    assert "(own)" in text and "| decode | prefill | swap | graphs | shared |" in text


def test_a_call_without_its_calibration_or_with_a_computron_policy_run_is_refused(tmp_path):
    d = _call(tmp_path, "call1", CPU_DEFAULT.to_dict(), seed=1)
    shutil.copy(d / "measured_default.json", d / "measured_computron.json")
    with pytest.raises(SystemExit, match="calibration of its executor"):
        drift.main([str(tmp_path), "--models", MODELS])
    (d / "measured_computron.json").unlink()
    (tmp_path / "call1" / "calibration_served.json").unlink()
    with pytest.raises(SystemExit, match="no calibration_served.json"):
        drift.main([str(tmp_path), "--models", MODELS])
    shutil.rmtree(d.parents[2])
    with pytest.raises(SystemExit, match="no call"):
        drift.main([str(tmp_path), "--models", MODELS])
