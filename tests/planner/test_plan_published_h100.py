"""Published H100 configurations that ran (bench/plan_validate_h100.py): the planner must never judge
one larger than the card it ran on, and its one published time stays within 15%."""

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
    timed = [r for r in rows if r["published_s"]]
    assert timed and all(abs(r["error"]) < 0.15 for r in timed), [(r["run"], r["error"]) for r in timed]
