"""The presets run by ``bench/gpu_sim_presets.sh``, in one Markdown table: per preset (and CV), each
policy's mean and p99 latency measured against the server and simulated, the simulation's error, and
how many times lower the default policy's mean and p99 are than the ``computron`` policy's (measured;
the issue's target is 3x or more for both).

    python3 bench/sim_presets_report.py [bench/results/presets]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

POLICIES = ("default", "computron")


def _latency(path: Path) -> tuple[float, float] | None:
    if not path.exists():
        return None
    lat = json.loads(path.read_text())["summary"]["all"]["latency"]
    return lat["mean"], lat["p99"]


def rows(root: Path) -> list[str]:
    out = []
    for trace in sorted(root.glob("*.jsonl")):
        tag = trace.stem  # PRESET_cvCV
        got = {p: (_latency(root / f"measured_{tag}_{p}.json"), _latency(root / f"sim_{tag}_{p}.json"))
               for p in POLICIES}
        cells = []
        for p in POLICIES:
            meas, sim = got[p]
            if meas is None or sim is None:
                cells.append("- | -")
                continue
            cells.append(f"{meas[0] * 1e3:,.0f} / {meas[1] * 1e3:,.0f} | {sim[0] * 1e3:,.0f} / {sim[1] * 1e3:,.0f} "
                         f"({sim[0] / meas[0] - 1:+.0%} / {sim[1] / meas[1] - 1:+.0%})")
        (d, _), (c, _) = got["default"], got["computron"]
        gain = f"{c[0] / d[0]:.1f}x / {c[1] / d[1]:.1f}x" if d and c else "-"
        preset, _, cv = tag.rpartition("_cv")
        out.append(f"| {preset} | {cv} | " + " | ".join(cells) + f" | {gain} |")
    return out


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "bench/results/presets")
    if not root.is_dir():
        print(f"no such directory: {root}", file=sys.stderr)
        return 2
    body = rows(root)
    if not body:
        print(f"no preset traces (*.jsonl) in {root}", file=sys.stderr)
        return 2
    print("| preset | CV | default measured mean / p99 ms | simulated (error) | computron measured mean / p99 ms | "
          "simulated (error) | computron over default, measured mean / p99 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
