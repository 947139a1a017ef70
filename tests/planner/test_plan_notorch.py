"""The planner (everything but profile.py) must import and run without torch."""

import subprocess
import sys
import textwrap


def test_planner_runs_without_torch():
    code = textwrap.dedent("""
        import sys
        sys.modules['torch'] = None  # any 'import torch' now raises ImportError
        import computron.planner
        import computron.planner.search, computron.planner.cli, computron.planner.pareto, computron.planner.profile
        from computron.planner import parse_compact, load_model, SearchOptions
        from computron.planner.search import search
        res = search(load_model('gpt2-345m'), parse_compact('a100-80gb:8x1,v100:8x1'), SearchOptions(top=1))
        assert res.plans
        assert all(not k.startswith('torch') or sys.modules[k] is None for k in sys.modules)
        print('ok')
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
