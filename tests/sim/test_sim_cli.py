"""`computron sim` end to end: generated and traced workloads, both policies, clear errors, no torch."""

import json
import subprocess
import sys

import pytest

from computron.cli import main

MODELS = "tiny-opt,tiny-llama,tiny-gpt2"


def _run(tmp_path, *argv):
    out = tmp_path / "sim.json"
    code = main(["sim", "--models", MODELS, "--budget", "1.35MB", "--out", str(out), *argv])
    return code, (json.loads(out.read_text()) if out.exists() else None)


def test_generated_workload_under_both_policies(tmp_path):
    code, res = _run(tmp_path, "--rate", "6", "--duration", "10", "--cv", "2", "--prompt", "32", "--output", "8")
    assert code == 0
    s = res["summary"]
    assert s["all"]["requests"] == len(res["records"]) > 20 and s["all"]["failed"] == 0
    assert set(s["models"]) == {"tiny-opt", "tiny-llama", "tiny-gpt2"} and s["stats"]["swap_ins"] >= 3
    assert all(r["finish"] >= r["first_token"] >= r["arrival"] for r in res["records"])
    code, old = _run(tmp_path, "--rate", "6", "--duration", "10", "--cv", "2", "--prompt", "32", "--output", "8",
                     "--policy", "computron")
    assert code == 0 and old["summary"]["all"]["requests"] == s["all"]["requests"]  # the same arrivals


def test_trace_file_and_its_errors(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"time": t, "model": m, "prompt_tokens": 16, "output_tokens": 4})
                               for t, m in [(0.0, "tiny-opt"), (0.01, "tiny-gpt2"), (0.02, "tiny-opt")]) + "\n")
    code, res = _run(tmp_path, "--trace", str(trace))
    assert code == 0 and [r["model"] for r in res["records"]] == ["tiny-opt", "tiny-gpt2", "tiny-opt"]
    assert all(r["finish_reason"] == "length" for r in res["records"])
    code, probed = _run(tmp_path / "p", "--trace", str(trace), "--loadgen-probes", "--policy", "computron",
                        "--max-loaded", "2")
    assert code == 0 and probed["settings"]["loadgen_probes"]  # the trace starts with both models resident:
    assert probed["summary"]["stats"]["swap_ins"] == 0  # the probes' loads are not the trace's
    assert [r["arrival"] for r in probed["records"]] == pytest.approx([0.0, 0.01, 0.02])  # relative to the trace's start
    trace.write_text(json.dumps({"time": 0, "model": "nope", "prompt_tokens": 1, "output_tokens": 1}) + "\n")
    assert _run(tmp_path / "x", "--trace", str(trace))[0] == 2
    assert "the trace names model(s) nope that --models does not" in capsys.readouterr().err
    assert main(["sim", "--models", MODELS, "--rate", "1", "--calibration", str(tmp_path / "missing.json")]) == 2
    assert "missing.json does not exist" in capsys.readouterr().err


def test_sim_runs_without_torch(tmp_path):
    code = ("import sys; sys.modules['torch'] = None; from computron.cli import main; "
            f"sys.exit(main(['sim', '--models', 'tiny-opt', '--rate', '2', '--duration', '3', '--out', "
            f"{str(tmp_path / 'o.json')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "o.json").read_text())["summary"]["all"]["failed"] == 0


def test_a_preset_of_small_models_holds_its_resident_models_beside_the_workspace(tmp_path):
    # the budget is R + 1/2 models and the 2 GiB workspace, exactly: rounded to a printed size it once
    # lost small models' bytes altogether ("workspace ... leaves nothing of the budget")
    out = tmp_path / "sim.json"
    assert main(["sim", "--preset", "3m-10-1-1", "--models", "tiny-opt", "--duration", "2", "--prompt", "16",
                 "--output", "4", "--out", str(out)]) == 0
    s = json.loads(out.read_text())["summary"]
    assert s["all"]["requests"] > 10 and s["all"]["failed"] == 0
    assert set(s["models"]) <= {"tiny-opt-0", "tiny-opt-1", "tiny-opt-2"}


def test_striped_loads_in_the_simulator_and_a_bad_device_list(tmp_path, capsys):
    args = ["--rate", "6", "--duration", "10", "--prompt", "32", "--output", "8", "--calibration", "h200-rough"]
    _, plain = _run(tmp_path, *args)
    code, striped = _run(tmp_path, *args, "--stripe-devices", "1,2,3")
    assert code == 0 and striped["summary"]["stats"]["swap_ins"] > 0 and plain["summary"]["stats"]["swap_ins"] > 0
    assert striped["summary"]["all"]["ttft"]["mean"] < plain["summary"]["all"]["ttft"]["mean"]
    assert _run(tmp_path, *args, "--stripe-devices", "1,x")[0] == 2
    assert "--stripe-devices takes distinct device indexes separated by commas, got '1,x'" in capsys.readouterr().err
