"""Published H100 configurations that ran (bench/plan_validate_h100.py): the planner must judge every
one to fit with its default memory margin (the issue's "no published configuration that ran is judged
'does not fit'"; the fp8 Llama 3 70B run at tp 4 pp 8 v 5 once was, 1.4 GiB over), and its one
published time stays within 8%."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "plan_validate_h100.py"


def test_every_published_run_fits_on_its_card():
    spec = importlib.util.spec_from_file_location("plan_validate_h100", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.validate(log=lambda s: None)
    assert len(rows) == len(mod.ROWS) == 5
    assert [r["run"] for r in rows if not r["fits_card"]] == []
    assert [r["run"] for r in rows if not r["fits"]] == []  # with the default 10% margin and 1 GiB reserve
    fp8 = next(r for r in rows if "fp8" in r["run"])
    assert fp8["max_mem_gib"] <= fp8["usable_gib"] - 3.0  # 65.0 of 71.0 GiB: not a near miss
    timed = [r for r in rows if r["published_s"]]
    assert timed and all(abs(r["error"]) < 0.08 for r in timed), [(r["run"], r["error"]) for r in timed]
