"""Instructions a compiled simulation executes, this checkout's against another's: a figure that other work
on the machine does not move, where wall time does.

Each version runs ``bench/sim_speed.py``'s workload (``--requests``, default 5,000) under
``valgrind --tool=callgrind``, counting only inside ``Simulation._run`` of the mypyc build
(``scripts/build_fast.sh`` in each checkout; ``COMPUTRON_COMPILED=1``). Both must simulate the same
outcome, or the script fails. Writes bench/results/sim_instructions.json (``--out``).

    .venv/bin/python bench/sim_instructions.py --reference-src /tmp/ref/src [--requests 5000]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOGGLE = "CPyDef_run___Simulation____run"  # the compiled Simulation._run


def child(requests: int) -> None:
    sys.path.insert(0, str(HERE))
    import sim_speed as ss
    from computron.config import EngineConfig

    if ss.path() != "compiled":
        raise SystemExit("sim_instructions.py: the compiled build did not load (scripts/build_fast.sh)")
    res, calls, _, _ = ss.run(ss.gamma_trace(requests, ss.MODELS, 8.0, 2.0, seed=0),
                              EngineConfig(gpu_memory_budget=30 * 2**30))
    print("RESULT " + json.dumps({"outcome": ss.outcome(res), "core_calls": calls}))


def measure(src: str, requests: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        env = {**os.environ, "PYTHONPATH": src, "COMPUTRON_COMPILED": "1"}
        p = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", f"--toggle-collect={TOGGLE}",
                            sys.executable, __file__, "--child", "--requests", str(requests)],
                           env=env, capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"sim_instructions.py: the run of {src} failed:\n{p.stderr[-2000:]}")
        got = json.loads(next(line[7:] for line in p.stdout.splitlines() if line.startswith("RESULT ")))
        totals = re.search(r"^(?:totals|summary): (\d+)", out.read_text(), re.M)
        if totals is None:
            raise SystemExit(f"sim_instructions.py: no instruction count in {out}")
        return {"src": src, "instructions": int(totals.group(1)), **got}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--reference-src", help="another checkout's src, with its own build")
    ap.add_argument("--label", default="")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results" / "sim_instructions.json"))
    a = ap.parse_args()
    if a.requests < 1:
        ap.error("--requests must be positive")
    if a.child:
        child(a.requests)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("sim_instructions.py: needs valgrind (callgrind)")
    mine = measure(str(HERE.parent / "src"), a.requests)
    row = {"label": a.label, "requests": a.requests, "counted": f"inside {TOGGLE} (compiled)", "this": mine,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"this checkout: {mine['instructions']:,} instructions, {mine['core_calls']} core calls")
    if a.reference_src:
        ref = measure(a.reference_src, a.requests)
        if ref["outcome"] != mine["outcome"]:
            raise SystemExit(f"sim_instructions.py: the versions simulate differently: {mine['outcome']} against "
                             f"{ref['outcome']}")
        row["reference"] = ref
        row["ratio"] = mine["instructions"] / ref["instructions"]
        print(f"reference {a.reference_src}: {ref['instructions']:,} instructions; this / reference "
              f"{row['ratio']:.4f}; same outcome {mine['outcome']}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(row, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
