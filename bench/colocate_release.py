"""How fast a colocated training job gives memory back, and what bounding its run-ahead costs it.

For each run-ahead bound (``--run-ahead 0,2,8,32``; 0 is unbounded, the reference, measured in the
same run), with each fence spacing of ``--fence-every``, one training job process (``--job gpt``:
``computron train`` on a GPT-2-medium shape; ``--job resnet``: ``examples/resnet_colocated.py``)
runs under an arbiter in this process (``colocate`` mode, ``--capacity-gb``). Each of ``--rounds``
rounds measures, in turn:

- throughput: the job's samples/s over ``--window`` seconds with no handover;
- ``--handovers`` handovers: inference demands ``--demand-gb`` more than it keeps while idle
  (once the shares have settled) at a random moment, the job shrinks its micro-batch (abandoning
  the running one) and acknowledges; the demand's wait and its parts (signal, the job's release:
  reaching its release point, then the release itself; ack) are recorded; after ``--idle`` s the
  memory goes back.

Reports per bound the median samples/s over rounds (and relative to unbounded) and the
p50/p99 of the wait and of the release over all handovers. With ``--profile-job N`` (``--job gpt``)
the job profiles N of its steps after each round's window (``train/profile.py``: how busy the GPU
was, the host's costliest calls), to find where a bound's cost goes. Writes
bench/results/colocate_release_<tag>.json.

    PYTHONPATH=src python bench/colocate_release.py --tag h100
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid import GB, JOBS, RESULTS, Job, ask_profile, gpt2_medium_checkpoint, job_command, take_profile  # noqa: E402

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


def measure(args, run_ahead: int, every: int, ckpt: str | None) -> dict:
    addr = tempfile.mktemp(suffix=".sock")
    capacity = int(args.capacity_gb * GB)
    server = ArbiterServer(Arbiter(ArbiterConfig(mode="colocate", capacity=capacity, idle_s=args.idle)), addr)
    args.run_ahead = run_ahead
    prof = Path(tempfile.mkdtemp(prefix="computron-release-profile-")) if args.profile_job else None
    extra = ["--colocate-fence-every", str(every)] if every > 1 else []
    job = Job(job_command(args, ckpt, addr, prof) + extra, profile=prof)
    rng = random.Random(args.seed)
    out = {"run_ahead": run_ahead, "fence_every": every, "samples_per_s": [], "micro_batches": [], "handovers": [],
           "no_release": 0, "profiles": []}
    try:
        out["warmup_s"] = job.wait_steps(args.warmup_steps, 0, f"run-ahead {run_ahead}")
        for _ in range(args.rounds):
            t0 = time.monotonic()
            time.sleep(args.window)
            out["samples_per_s"].append(job.samples_per_s(t0, time.monotonic(), args.global_batch))
            out["micro_batches"].append(job.micro_batches(t0, time.monotonic()))  # a shrunk size shows here
            if prof is not None:
                before = {f.name for f in prof.glob("profile_*.json")}
                ask_profile(job, 0.0)
                out["profiles"].append(take_profile(job, before, (0.0, float("inf")), timeout_s=60.0, top=15))
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


def label(r: dict) -> str:
    if not r["run_ahead"]:
        return "unbounded"
    return f"{r['run_ahead']}" + (f"/{r['fence_every']}" if r["fence_every"] > 1 else "")


def row(r: dict, unbounded: float | None) -> dict:
    rate = float(np.median(r["samples_per_s"]))
    out = {"run_ahead": r["run_ahead"], "fence_every": r["fence_every"], "samples_per_s": rate,
           "handovers": len(r["handovers"]),
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
    p.add_argument("--fence-every", default="1", help="gpt: for each bound, these fence spacings (in watched points)")
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
    p.add_argument("--profile-job", type=int, default=0, metavar="STEPS",
                   help="gpt: profile this many of the job's steps after each round's window (0: none)")
    p.add_argument("--tag", default="h100")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    for k, v in JOBS[args.job].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    def ints(flag: str, text: str, least: int) -> list[int]:
        try:
            out = [int(x) for x in text.split(",")]
        except ValueError:
            p.error(f"{flag} takes whole numbers separated by commas, got {text!r}")
        if min(out) < least:
            p.error(f"{flag} takes numbers from {least} up, got {text!r}")
        return out

    bounds = ints("--run-ahead", args.run_ahead, 0)
    everies = ints("--fence-every", args.fence_every, 1)
    if any(k > b for b in bounds if b for k in everies):
        p.error(f"--fence-every {args.fence_every} spaces fences wider than a bound of --run-ahead {args.run_ahead}")
    ckpt = None
    if args.job == "gpt":
        ckpt = args.train_model or gpt2_medium_checkpoint(Path(tempfile.gettempdir()) / "computron-gpt2-medium")
    if args.job != "gpt" and everies != [1]:
        p.error("--fence-every spaces computron train's fences (--job gpt)")
    runs = [measure(args, b, k, ckpt) for b in bounds for k in (everies if b else [1])]
    unbounded = next((float(np.median(r["samples_per_s"])) for r in runs if r["run_ahead"] == 0), None)
    rows = [row(r, unbounded) for r in runs]
    args.run_ahead = ",".join(map(str, bounds))
    args.fence_every = ",".join(map(str, everies))
    out = Path(args.out) / f"colocate_release_{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "runs": runs,
                               "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    print(f"{'run-ahead':>9} {'samples/s':>10} {'relative':>8} {'wait p50/p99 ms':>16} {'release p50/p99 ms':>19} n"
          " (no release)")
    for r in rows:
        print(f"{label(r):>9} {r['samples_per_s']:10.1f} {r.get('relative', float('nan')):8.3f} "
              f"{r.get('wait_p50_ms', float('nan')):7.1f}/{r.get('wait_p99_ms', float('nan')):<8.1f} "
              f"{r.get('release_p50_ms', float('nan')):9.1f}/{r.get('release_p99_ms', float('nan')):<9.1f} "
              f"{r['handovers']} ({r['no_release']})")
    for r in rows:
        print(f"{label(r):>9} parts p50/p99 ms: " + "  ".join(
            f"{k[:-2]} {r[f'{k[:-2]}_p50_ms']:.1f}/{r[f'{k[:-2]}_p99_ms']:.1f}" for k in PARTS[1:]
            if f"{k[:-2]}_p50_ms" in r))
    for r in runs:  # each round's rate, and the micro-batch sizes it ran (a job left shrunk shows here)
        print(f"{label(r):>9} rounds: " + "  ".join(
            f"{rate:.0f}/s {dict(sorted(collections.Counter(m).items()))}"
            for rate, m in zip(r["samples_per_s"], r["micro_batches"])))
    for r in runs:  # the job's own view of its profiled steps (--profile-job)
        for w in filter(None, r["profiles"]):
            busy = "" if w["device_busy_share"] is None else f"GPU busy {w['device_busy_share']:.3f} of "
            host = ", ".join(f"{h['name']} {h['self_s']:.3f} s ({h['calls']})" for h in w["top_host"][:8])
            print(f"{label(r):>9} profile: {busy}{w['wall_s']:.2f} s, host {host}")
    for r in runs:  # where the job's loop was when each order came, and what the wait was then
        by_at: dict[str, list[float]] = {}
        for h in r["handovers"]:
            by_at.setdefault(h.get("at") or "?", []).append(1e3 * h["wait_s"])
        print(f"{label(r):>9} wait by where the order found the job: " + "  ".join(
            f"{at} {len(v)}: p50 {np.percentile(v, 50):.1f} max {max(v):.1f} ms" for at, v in sorted(by_at.items())))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
