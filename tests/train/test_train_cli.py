"""``computron train`` from the command line: a text file, per-step JSON; help and the arbiter without torch."""

import json
import subprocess
import sys

from computron.cli import main


def test_train_on_a_text_file_writes_records(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "train.json"
    assert main(["train", "--data", str(text), "--steps", "2", "--seq-len", "16", "--global-batch", "4",
                 "--micro-batch", "2", "--device", "cpu", "--json", str(out)]) == 0
    recs = json.loads(out.read_text())["steps"]
    assert [r["step"] for r in recs] == [1, 2] and all(r["micro_batches"] == [2, 2] for r in recs)
    assert "step 2/2 loss" in capsys.readouterr().out


def test_train_reports_a_bad_model_as_an_error(capsys):
    assert main(["train", "--model", "no-such-model", "--device", "cpu"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_help_and_the_arbiter_need_no_torch():
    code = ("import sys; sys.modules['torch'] = None; "
            "import computron.colocate.arbiter, computron.colocate.memmodel, computron.colocate.protocol, "
            "computron.colocate.standin; from computron.cli import main; sys.exit(main(['train', '--help']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: computron train")
