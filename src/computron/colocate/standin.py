"""An inference-side stand-in: an :class:`ArbiterServer` driven by commands on stdin, one JSON answer a line.

For tests and benchmarks of the handover without an inference engine: it asks for memory the
way the engine would (``demand``), and reports what the arbiter granted and how long training
took to give it. Commands: ``demand DEVICE BYTES [TIMEOUT_S]``, ``idle DEVICE``, ``wait-trainer
DEVICE TIMEOUT_S``, ``status DEVICE``, ``quit``. Run: ``python -m computron.colocate.standin
--address PATH --mode colocate --capacity BYTES``. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .arbiter import Arbiter, ArbiterConfig, MODES
from .protocol import ArbiterServer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m computron.colocate.standin", description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True, help="a Unix socket path or host:port")
    p.add_argument("--mode", choices=MODES, default="colocate")
    p.add_argument("--capacity", type=int, required=True, help="bytes shared per device")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--idle", type=float, default=1.0, help="seconds of idle before memory goes back")
    p.add_argument("--static-train", type=int, default=0)
    p.add_argument("--at-boundary", action="store_true", help="training releases at its next micro-batch boundary")
    args = p.parse_args(argv)
    cfg = ArbiterConfig(mode=args.mode, capacity=args.capacity, static_train=args.static_train, idle_s=args.idle,
                        immediate=not args.at_boundary)
    server = ArbiterServer(Arbiter(cfg, args.devices), args.address)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        try:
            if cmd[0] == "demand":
                out = server.demand(int(cmd[1]), int(cmd[2]), float(cmd[3]) if len(cmd) > 3 else None)
            elif cmd[0] == "idle":
                server.demand(int(cmd[1]), 0)
                out = {"ok": True}
            elif cmd[0] == "wait-trainer":
                deadline = time.monotonic() + float(cmd[2])
                while not server.trainer_connected(int(cmd[1])) and time.monotonic() < deadline:
                    time.sleep(0.01)
                out = {"connected": server.trainer_connected(int(cmd[1]))}
            elif cmd[0] == "status":
                d = int(cmd[1])
                inf, train = server.arbiter.shares(d)
                out = {"connected": server.trainer_connected(d), "inference": inf, "training": train,
                       "budget": server.budgets[d]}
            elif cmd[0] == "quit":
                break
            else:
                out = {"error": f"unknown command {cmd[0]!r}"}
        except (TimeoutError, ValueError, IndexError) as e:
            out = {"error": str(e)}
        print(json.dumps(out), flush=True)
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
