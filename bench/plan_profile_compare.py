"""Compare measured layer profiles (``computron plan profile`` output) with the roofline model.

For every profile file given (default: bench/results/plan_profile_*.json) and every entry, prints
measured forward/backward/activation figures of one layer shard next to what costs.py predicts
for the same GPU type, and writes bench/results/plan_profile_compare.json.

    python bench/plan_profile_compare.py [profile.json ...]
"""

from __future__ import annotations

import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from computron.planner import costs  # noqa: E402
from computron.planner.hardware import GPU_TYPES  # noqa: E402
from computron.planner.model import preset  # noqa: E402


def main(paths: list[str]) -> int:
    paths = paths or sorted(glob.glob(os.path.join(HERE, "results", "plan_profile_h*.json")))
    rows = []
    for path in paths:
        with open(path) as f:
            prof = json.load(f)
        gpu = GPU_TYPES.get(prof["gpu"])
        if gpu is None:
            print(f"{path}: GPU type {prof['gpu']!r} has no roofline preset; skipped")
            continue
        m = preset(prof["model"]["name"])
        for e in prof["entries"]:
            f_pred, b_pred = costs.layer_compute(m, gpu, e["tp"], e["mbs"])
            act_pred = costs.activation_bytes(m, e["tp"], e["mbs"])
            row = {"model": m.name, "gpu": gpu.name, "device": prof["device_name"], "dtype": prof["dtype"],
                   "tp": e["tp"], "mbs": e["mbs"],
                   "fwd_ms": round(e["fwd_s"] * 1e3, 3), "fwd_roofline_ms": round(f_pred * 1e3, 3),
                   "bwd_ms": round(e["bwd_s"] * 1e3, 3), "bwd_roofline_ms": round(b_pred * 1e3, 3),
                   "fwd_ratio": round(f_pred / e["fwd_s"], 3), "bwd_ratio": round(b_pred / e["bwd_s"], 3),
                   "act_mib": round(e["act_bytes"] / 2**20, 1), "act_formula_mib": round(act_pred / 2**20, 1)}
            rows.append(row)
            print(f"{m.name:10s} {gpu.name} tp={e['tp']} mbs={e['mbs']:2d}: fwd {row['fwd_ms']:7.3f} ms "
                  f"(roofline {row['fwd_roofline_ms']:7.3f}, x{row['fwd_ratio']:.2f}), bwd {row['bwd_ms']:7.3f} ms "
                  f"(roofline {row['bwd_roofline_ms']:7.3f}, x{row['bwd_ratio']:.2f}), activations "
                  f"{row['act_mib']:7.1f} MiB (formula {row['act_formula_mib']:7.1f})")
    out = os.path.join(HERE, "results", "plan_profile_compare.json")
    with open(out, "w") as f:
        json.dump({"note": "ratio = roofline / measured (1.0 = exact; < 1 = roofline optimistic)",
                   "profiles": [os.path.basename(p) for p in paths], "rows": rows}, f, indent=2)
        f.write("\n")
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
