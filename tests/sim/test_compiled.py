"""The optional mypyc build (``scripts/build_fast.sh``, ``computron._fast``): it simulates exactly as
the Python modules do, and a build that is not of the current sources is never loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sim_golden import CASES, GOLDEN, outcome

from computron import _fast

ROOT = Path(__file__).resolve().parents[2]


def _manifest(tmp_path: Path, **over) -> Path:
    files = {m: f"{m}{_fast.suffix()}" for m in _fast.MODULES}
    for f in files.values():
        (tmp_path / f).write_bytes(b"")
    man = {"suffix": _fast.suffix(), "sources": _fast.source_hashes(), "files": files, **over}
    (tmp_path / "manifest.json").write_text(json.dumps(man))
    return tmp_path


def test_a_build_of_other_sources_or_another_python_is_refused(tmp_path):
    assert _fast.check(tmp_path / "none")[1].startswith("no compiled build")
    assert _fast.check(_manifest(tmp_path))[0] is not None  # this one would be loaded
    stale = dict(_fast.source_hashes(), **{"computron.scheduler.scheduler": "0" * 64})
    assert "other sources of computron.scheduler.scheduler" in _fast.check(_manifest(tmp_path, sources=stale))[1]
    assert "this Python loads" in _fast.check(_manifest(tmp_path, suffix=".cpython-39-x.so"))[1]


def test_without_the_variable_the_python_modules_run():
    env = {k: v for k, v in os.environ.items() if k != _fast.ENV}
    out = subprocess.run([sys.executable, "-c", "import computron.sim; from computron import _fast; "
                          "print(_fast.compiled_modules())"], env={**env, "PYTHONPATH": str(ROOT / "src")},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _with_build(code: str, *args: str) -> str:
    """The last line ``code`` prints, run with the compiled build (skips without a usable one)."""
    files, why = _fast.check()
    if files is None:
        pytest.skip(f"no usable compiled build: {why}")
    env = {**os.environ, _fast.ENV: "1", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code, *args],
                         env=env, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()[-1]


def test_the_compiled_build_simulates_exactly_as_the_python_modules():
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from sim_golden import CASES, outcome; "
            "from computron import _fast; print(json.dumps({'modules': _fast.compiled_modules(), "
            "'cases': {n: outcome(n) for n in sorted(CASES)}}))")
    got = json.loads(_with_build(code, str(Path(__file__).parent)))
    assert sorted(got["modules"]) == sorted(_fast.MODULES)  # the build ran, all of it
    if not _fast.requested():
        assert _fast.compiled_modules() == []  # and this process ran the Python modules
    golden = json.loads(GOLDEN.read_text())
    for name in sorted(CASES):
        assert got["cases"][name] == outcome(name), name
        assert got["cases"][name]["digest"] == golden[name]["digest"], name


def test_the_compiled_step_times_take_ints_and_floats_as_the_python_module_does():
    calls = ("[b(c, 2000000000, 10, 3), b(c, 2e9, 10.0, 3.0, 1), b(c, 10**9, 0, 8), "
             "p(0, 1, [5, 5], [2, 4]), p(0.0, 10.0, [5.0, 5], [2.0, 4.0])]")
    code = ("from computron.sim.costs import CPU_DEFAULT as c, batch_time as b, pipelined_finish as p; "
            f"print(type(b).__name__, repr({calls}))")
    kind, got = _with_build(code).split(" ", 1)
    assert kind == "builtin_function_or_method"  # the compiled function ran
    from computron.sim.costs import CPU_DEFAULT as c, batch_time as b, pipelined_finish as p
    assert got == repr([b(c, 2000000000, 10, 3), b(c, 2e9, 10.0, 3.0, 1), b(c, 10**9, 0, 8),
                        p(0, 1, [5, 5], [2, 4]), p(0.0, 10.0, [5.0, 5], [2.0, 4.0])])


def test_the_compiled_core_takes_a_colocation_link_and_calls_it_around_each_step():
    # the compiled EngineCore types its attributes: a link must be accepted (an attribute once inferred
    # as None refused every EngineLink) and called before and after each step
    code = ("from computron import _fast; from computron.config import EngineConfig, ModelSpec; "
            "from computron.engine import Engine; from computron.messages import SamplingParams\n"
            "class Link:\n    calls = []\n    def poll(self): self.calls.append('poll')\n"
            "    def after_step(self): self.calls.append('after')\n"
            "e = Engine(EngineConfig(device='cpu')); e.register_model(ModelSpec('tiny-opt'))\n"
            "e.core.colocation = link = Link()\n"
            "r = e.submit('tiny-opt', [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))\n"
            "e.step(); print('computron.engine.core' in _fast.compiled_modules(), link.calls)")
    assert _with_build(code) == "True ['poll', 'after']"
