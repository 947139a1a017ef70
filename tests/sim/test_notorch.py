"""Everything in computron.sim imports and runs without torch."""

import subprocess
import sys
import textwrap


def test_sim_runs_without_torch():
    code = textwrap.dedent("""
        import sys
        sys.modules['torch'] = None  # any 'import torch' now raises ImportError
        import computron.sim, computron.sim.costs, computron.sim.executor, computron.sim.run
        import computron.sim.clock, computron.sim.layout
        from computron.sim import simulate
        res = simulate([(0.0, 'tiny-opt', 8, 4), (0.0, 'tiny-llama', 8, 4)], ['tiny-opt', 'tiny-llama', 'opt-125m'])
        assert [r.finish_reason for r in res.records] == ['length', 'length']
        assert all(not k.startswith('torch') or sys.modules[k] is None for k in sys.modules)
        print('ok')
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
