"""examples/resnet_colocated.py: its ResNet-50 has torchvision's shapes, and under the arbiter its
micro-batch shrinks when inference asks for memory, training goes on, and grows back after."""

import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from computron.colocate.arbiter import Arbiter, ArbiterConfig
from computron.colocate.protocol import ArbiterServer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "resnet_colocated.py"
spec = importlib.util.spec_from_file_location("resnet_colocated", EXAMPLE)
resnet = importlib.util.module_from_spec(spec)
spec.loader.exec_module(resnet)
SMALL = ["--device", "cpu", "--depth", "14", "--width", "16", "--image-size", "32", "--classes", "10",
         "--global-batch", "8", "--micro-batch", "8", "--pool", "16", "--lr", "0.01"]


def test_resnet50_has_torchvisions_parameters_and_shapes():
    model = resnet.ResNet(resnet.BLOCKS[50], 1000)
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision's resnet50
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["layer1.0.downsample.0.weight"] == (256, 64, 1, 1)
    assert shapes["layer4.2.conv3.weight"] == (2048, 512, 1, 1)
    assert shapes["layer2.0.conv2.weight"] == (128, 128, 3, 3)  # the stride sits on the 3x3 convolution
    assert shapes["fc.weight"] == (1000, 2048)
    model.eval()
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 1000)
    assert model.layer2[0].conv2.stride == (2, 2) and model.layer2[0].conv1.stride == (1, 1)


def run_with_limit(at_call: int, immediate: bool):
    """A one-step run (micro-batches of 4) that gets a limit fitting 2 samples while ``layer3`` runs
    for the ``at_call``-th time; the model it trained."""
    args = resnet.parser().parse_args([*SMALL, "--steps", "1", "--micro-batch", "4"])
    orig, seen = resnet.Colocation.watch, {}

    def watch(self, model):
        calls = {"n": 0}

        def late(*_):
            calls["n"] += 1
            if calls["n"] == at_call:
                self.deliver({"t": "limit", "id": 1, "bytes": self.memory.predict(2), "immediate": immediate})

        model.layer3.register_forward_hook(late)
        seen["model"], seen["colo"] = model, self
        orig(self, model)

    resnet.Colocation.watch = watch
    try:
        recs = resnet.train(args, log=lambda s: None)
    finally:
        resnet.Colocation.watch = orig
    return recs[0], seen["model"], seen["colo"]


def test_an_abandoned_micro_batch_leaves_nothing_behind():
    # reference: the limit comes in the first micro-batch and waits for its end: [4, 2, 2], nothing abandoned
    ref, ref_model, ref_colo = run_with_limit(1, immediate=False)
    # the limit comes in the second micro-batch's forward (the stem's and layer1-3's batch norms have run)
    got, got_model, got_colo = run_with_limit(2, immediate=True)
    assert ref["micro_batches"] == got["micro_batches"] == [4, 2, 2]
    assert (ref_colo.abandoned, got_colo.abandoned) == (0, 1)
    assert got["loss"] == ref["loss"]
    for (name, a), b in zip(ref_model.state_dict().items(), got_model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)  # running statistics and weights alike


def wait_line(lines, cond, pattern, start, timeout=120.0):
    with cond:
        ok = cond.wait_for(lambda: any(re.search(pattern, x) for x in lines[start:]), timeout)
    assert ok, f"no line matching {pattern!r} in {lines[start - 1:start + 5]}"
    return next(i for i in range(start, len(lines)) if re.search(pattern, lines[i]))


def test_colocated_resnet_shrinks_for_inference_and_grows_back(tmp_path):
    mm = resnet.memory_model(resnet.parser().parse_args(SMALL))
    capacity = mm.predict(8)
    demand = capacity - mm.predict(3)
    addr = str(tmp_path / "arbiter.sock")
    server = ArbiterServer(Arbiter(ArbiterConfig(mode="colocate", capacity=capacity, idle_s=1.0)), addr)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    job = subprocess.Popen([sys.executable, str(EXAMPLE), *SMALL, "--steps", "100000", "--colocate", addr],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
    lines, cond = [], threading.Condition()

    def read():
        for line in job.stdout:
            with cond:
                lines.append(line.rstrip())
                cond.notify_all()

    threading.Thread(target=read, daemon=True).start()
    try:
        i = wait_line(lines, cond, r"micro-batches \[8\]", 0)
        rec = server.demand(0, demand, timeout=60)  # returns once training has acknowledged the smaller limit
        assert rec["granted"] == demand and rec["release_s"] is not None
        assert server.arbiter.shares(0) == (demand, capacity - demand)
        i = wait_line(lines, cond, r"micro-batches \[[1-3][,\]]", i + 1)  # at most 3 samples (until memory is back)
        n = int(re.match(r"step (\d+)/", lines[i]).group(1))
        deadline = time.monotonic() + 60  # inference idles: the memory goes back, full micro-batches again
        while server.arbiter.shares(0)[1] != capacity and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.arbiter.shares(0) == (0, capacity)
        i = wait_line(lines, cond, r"micro-batches \[8\]", i + 1)
        assert int(re.match(r"step (\d+)/", lines[i]).group(1)) > n and job.poll() is None
    finally:
        job.kill()
        job.wait(10)
        server.close()
