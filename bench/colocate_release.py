"""How fast a colocated training job gives memory back, and what bounding its run-ahead costs it.

For each run-ahead bound (``--run-ahead 0,2,8,32``; 0 is unbounded, the reference, measured in the
same run) one training job process (``--job gpt``: ``computron train`` on a GPT-2-medium shape;
``--job resnet``: ``examples/resnet_colocated.py``) runs under an arbiter in this process
(``colocate`` mode, ``--capacity-gb``). Each of ``--rounds`` rounds measures, in turn:

- throughput: the job's samples/s over ``--window`` seconds with no handover;
- ``--handovers`` handovers: inference demands ``--demand-gb`` more than it keeps while idle
  (once the shares have settled) at a random moment, the job shrinks its micro-batch (abandoning
  the running one) and acknowledges; the demand's wait and its parts (signal, the job's release:
  reaching its release point, then the release itself; ack) are recorded; after ``--idle`` s the
  memory goes back.

Reports per bound the median samples/s over rounds (and relative to unbounded) and the
p50/p99 of the wait and of the release over all handovers. Writes
bench/results/colocate_release_<tag>.json.

    PYTHONPATH=src python bench/colocate_release.py --tag h100
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid import GB, JOBS, RESULTS, Job, gpt2_medium_checkpoint, job_command  # noqa: E402

from computron.colocate.arbiter import Arbiter, ArbiterConfig  # noqa: E402
from computron.colocate.protocol import ArbiterServer  # noqa: E402


# a handover's wait, from the demand to the memory free, and its parts (``ArbiterServer.demand``)
PARTS = ("wait_s", "signal_s", "release_s", "reach_s", "drain_s", "empty_s", "ack_s")


def said(job: Job) -> str:
    """Whether the job runs, and its last lines: for an error."""
    state = "running" if job.p.poll() is None else f"exited with {job.p.returncode}"
    return f"the job ({state}) said last:\n" + "\n".join(job.last_lines)


def wait_settled(server: ArbiterServer, job: Job, timeout: float = 60.0) -> int:
    """Wait until both sides hold what they hold while inference is idle; inference's share then.

    Training gets back all it can use, not the whole capacity: ``colocate`` caps its limit at the
    most the job says it can use, and idle inference keeps the rest."""
    deadline = time.monotonic() + timeout
    while not (rec := server.records(since=time.monotonic()))["settled"][0]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the shares did not settle within {timeout} s: (inference, training) "
                               f"{rec['shares'][0]}; {said(job)}")
        time.sleep(0.005)
    return rec["shares"][0][0]


def measure(args, run_ahead: int, ckpt: str | None) -> dict:
    addr = tempfile.mktemp(suffix=".sock")
    capacity = int(args.capacity_gb * GB)
    server = ArbiterServer(Arbiter(ArbiterConfig(mode="colocate", capacity=capacity, idle_s=args.idle)), addr)
    args.run_ahead = run_ahead
    job = Job(job_command(args, ckpt, addr))
    rng = random.Random(args.seed)
    out = {"run_ahead": run_ahead, "samples_per_s": [], "handovers": [], "no_release": 0}
    try:
        out["warmup_s"] = job.wait_steps(args.warmup_steps, 0, f"run-ahead {run_ahead}")
        for _ in range(args.rounds):
            t0 = time.monotonic()
            time.sleep(args.window)
            out["samples_per_s"].append(job.samples_per_s(t0, time.monotonic(), args.global_batch))
            for _ in range(args.handovers):
                idle_share = wait_settled(server, job)  # the memory is back with training before the next demand
                time.sleep(rng.uniform(0, args.gap))  # a random moment of the job's step
                try:  # on top of what idle inference keeps (in colocate, what the job cannot use)
                    rec = server.demand(0, idle_share + int(args.demand_gb * GB), timeout=60)
                except TimeoutError as e:  # say what the job and the arbiter were doing
                    raise RuntimeError(f"{e}; arbiter shares (inference, training) {server.arbiter.shares(0)}; "
                                       f"{said(job)}") from None
                if rec["release_s"] is not None:
                    out["handovers"].append({**{k: rec[k] for k in PARTS}, "at": rec["at"]})
                else:  # the job's memory was not needed: no handover to time
                    out["no_release"] += 1
                server.demand(0, 0)  # inference idles from now: after --idle the memory goes back
    finally:
        job.stop()
        server.close()
    return out


def row(r: dict, unbounded: float | None) -> dict:
    rate = float(np.median(r["samples_per_s"]))
    out = {"run_ahead": r["run_ahead"], "samples_per_s": rate, "handovers": len(r["handovers"]),
           "no_release": r["no_release"]}
    if unbounded:
        out["relative"] = rate / unbounded
    for key in PARTS:
        vals = [h[key] for h in r["handovers"]]
        if vals:
            out[f"{key[:-2]}_p50_ms"] = 1e3 * float(np.percentile(vals, 50))
            out[f"{key[:-2]}_p99_ms"] = 1e3 * float(np.percentile(vals, 99))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-ahead", default="0,2,8,32", help="bounds to compare (0: unbounded, the reference)")
    p.add_argument("--job", choices=sorted(JOBS), default="gpt")
    p.add_argument("--train-model", default=None, help="gpt: the job's model (default: a GPT-2-medium shape)")
    p.add_argument("--train-args", default="", help="more arguments for the job's command line")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=None, help="default: gpt 32, resnet 128")
    p.add_argument("--micro-batch", type=int, default=None, help="default: gpt 16, resnet 64")
    p.add_argument("--capacity-gb", type=float, default=24.0, help="GB the job may hold with no inference")
    p.add_argument("--demand-gb", type=float, default=8.0, help="GB each handover takes from the job")
    p.add_argument("--idle", type=float, default=0.3, help="seconds before the memory goes back to training")
    p.add_argument("--gap", type=float, default=0.5, help="a handover starts up to this long after the memory is back")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window", type=float, default=8.0, help="seconds of each throughput measurement")
    p.add_argument("--handovers", type=int, default=15, help="handovers per round")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="h100")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    for k, v in JOBS[args.job].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    bounds = [int(x) for x in args.run_ahead.split(",")]
    ckpt = None
    if args.job == "gpt":
        ckpt = args.train_model or gpt2_medium_checkpoint(Path(tempfile.gettempdir()) / "computron-gpt2-medium")
    runs = [measure(args, b, ckpt) for b in bounds]
    unbounded = next((float(np.median(r["samples_per_s"])) for r in runs if r["run_ahead"] == 0), None)
    rows = [row(r, unbounded) for r in runs]
    args.run_ahead = ",".join(map(str, bounds))
    out = Path(args.out) / f"colocate_release_{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "runs": runs,
                               "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    print(f"{'run-ahead':>9} {'samples/s':>10} {'relative':>8} {'wait p50/p99 ms':>16} {'release p50/p99 ms':>19} n"
          " (no release)")
    for r in rows:
        print(f"{r['run_ahead'] or 'unbounded':>9} {r['samples_per_s']:10.1f} {r.get('relative', float('nan')):8.3f} "
              f"{r.get('wait_p50_ms', float('nan')):7.1f}/{r.get('wait_p99_ms', float('nan')):<8.1f} "
              f"{r.get('release_p50_ms', float('nan')):9.1f}/{r.get('release_p99_ms', float('nan')):<9.1f} "
              f"{r['handovers']} ({r['no_release']})")
    for r in rows:
        print(f"{r['run_ahead'] or 'unbounded':>9} parts p50/p99 ms: " + "  ".join(
            f"{k[:-2]} {r[f'{k[:-2]}_p50_ms']:.1f}/{r[f'{k[:-2]}_p99_ms']:.1f}" for k in PARTS[1:]
            if f"{k[:-2]}_p50_ms" in r))
    for r in runs:  # where the job's loop was when each order came, and what the wait was then
        by_at: dict[str, list[float]] = {}
        for h in r["handovers"]:
            by_at.setdefault(h.get("at") or "?", []).append(1e3 * h["wait_s"])
        print(f"{r['run_ahead'] or 'unbounded':>9} wait by where the order found the job: " + "  ".join(
            f"{at} {len(v)}: p50 {np.percentile(v, 50):.1f} max {max(v):.1f} ms" for at, v in sorted(by_at.items())))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
