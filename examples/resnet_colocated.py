"""A ResNet trained with SGD on synthetic images, sharing its GPU with inference through colocation.

The hybrid workload of the original system: an image classifier whose micro-batch shrinks, or
which pauses, when the inference server beside it needs memory, and grows back when inference
idles. ResNet-50 is torchvision's when torchvision is importable; otherwise (and for the other
depths and widths) the same network is built here from torch.nn: bottleneck blocks (1x1, 3x3 with the
stride, 1x1 to 4x the width), a projection shortcut where the shape changes, the same module names
and parameter shapes as torchvision's. Images and labels are random, fixed by the seed and the
sample's number, kept on the host; each micro-batch's images are copied to the device.

Each step takes ``--global-batch`` samples in micro-batches of at most ``--micro-batch``, as many
as colocation lets through (``Colocation.micro_batch``); a micro-batch's loss is its summed
cross-entropy over the global batch size, its gradients come from ``autograd.grad`` and are added
up, so an abandoned micro-batch leaves nothing behind (its batch-norm running statistics are put
back too) and is redone with the same samples. Prints one line a step, as ``computron train`` does.

    python -m computron.colocate.standin --address /tmp/arb.sock --mode colocate --capacity 20000000000 &
    PYTHONPATH=src python examples/resnet_colocated.py --device cuda --colocate /tmp/arb.sock
    PYTHONPATH=src python examples/resnet_colocated.py --device cpu --depth 14 --image-size 32 --steps 3
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

from computron.colocate.client import Colocation
from computron.colocate.devpool import releaser
from computron.colocate.memmodel import MemoryModel
from computron.colocate.park import Parking, training_slots

BLOCKS = {14: (1, 1, 1, 1), 26: (2, 2, 2, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """Images ``[n, 3, s, s]`` in, class logits ``[n, classes]`` out."""

    def __init__(self, blocks=BLOCKS[50], classes: int = 1000, width: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = width
        for i, (n, planes) in enumerate(zip(blocks, (width, 2 * width, 4 * width, 8 * width))):
            layers = []
            for j in range(n):
                layers.append(Bottleneck(inplanes, planes, 2 if j == 0 and i > 0 else 1))
                inplanes = planes * Bottleneck.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build(depth: int, classes: int, width: int = 64) -> nn.Module:
    if depth not in BLOCKS:
        raise ValueError(f"depth must be one of {sorted(BLOCKS)}, got {depth}")
    if depth == 50 and width == 64:
        try:
            from torchvision.models import resnet50
        except ImportError:
            pass
        else:
            return resnet50(num_classes=classes)
    return ResNet(BLOCKS[depth], classes, width)


def memory_model(args) -> MemoryModel:
    """A prior: weights, gradient accumulators, a micro-batch's gradients and SGD momentum (4 x 4
    bytes a parameter) fixed; per sample, every leaf module's output in float32. Measured peaks
    refine it on the GPU."""
    with torch.device("meta"):
        model = build(args.depth, args.classes, args.width).eval()  # one sample: batch-norm's statistics are not needed
        acts = []
        hooks = [m.register_forward_hook(lambda _m, _i, out: acts.append(out.numel()))
                 for m in model.modules() if not any(True for _ in m.children())]
        model(torch.empty(1, 3, args.image_size, args.image_size))
    for h in hooks:
        h.remove()
    fixed = 16 * sum(p.numel() for p in model.parameters())
    return MemoryModel(fixed, 4 * (sum(acts) + 3 * args.image_size ** 2))


class Images:
    """Synthetic samples: image and label of sample ``i`` fixed by the seed (host memory)."""

    def __init__(self, n: int, size: int, classes: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, size, size, generator=g)
        self.y = torch.randint(classes, (n,), generator=g)

    def batch(self, ids: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(ids) % len(self.y)
        return self.x[idx].to(device, non_blocking=True), self.y[idx].to(device, non_blocking=True)


def train(args, log=print) -> list[dict]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(args.seed)
    model = build(args.depth, args.classes, args.width).to(device)
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    # a pause parks weights, gradients, momentum and batch-norm statistics in pinned host memory
    parking = Parking(lambda: training_slots(params, opt, model.buffers()), device)
    colo = Colocation(args.colocate, args.colocate_device, memory_model(args),
                      on_pause=parking.park, on_resume=lambda: parking.unpark(colo.resume_stopped),
                      release=releaser(device),
                      measure=(torch.cuda.reset_peak_memory_stats, torch.cuda.max_memory_allocated) if cuda else None,
                      run_ahead=args.run_ahead if args.colocate else 0)
    colo.watch(model)
    if args.colocate and not colo.wait_connected(10.0):
        print(f"warning: no arbiter at {args.colocate} yet; training unlimited until it answers", file=sys.stderr)
    data = Images(args.pool, args.image_size, args.classes, args.seed)
    bf16 = cuda and args.dtype == "bfloat16"
    out, t_start = [], time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        ids = list(range(step * args.global_batch, (step + 1) * args.global_batch))
        for p in params:
            p.grad = None
        pos, loss, sizes = 0, 0.0, []
        while pos < len(ids):
            m = min(colo.micro_batch(args.micro_batch), len(ids) - pos)
            x, y = data.batch(ids[pos:pos + m], device)
            if cuda:
                x = x.contiguous(memory_format=torch.channels_last)
            stats = [b.clone() for b in model.buffers()]
            with colo.step(m) as s:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    logits = model(x)
                part = F.cross_entropy(logits.float(), y, reduction="sum") / len(ids)
                grads = torch.autograd.grad(part, params)
            if s.abandoned:  # the same samples again, at the size that fits now
                with torch.no_grad():
                    for b, v in zip(model.buffers(), stats):
                        b.copy_(v)
                continue
            for p, g in zip(params, grads):
                p.grad = g if p.grad is None else p.grad.add_(g)
            del grads
            loss += float(part.detach())
            sizes.append(m)
            pos += m
        opt.step()
        if step == 0 and args.colocate and cuda:  # the pinned buffers a pause needs, page-locked while it trains
            threading.Thread(target=parking.reserve, daemon=True).start()
        if cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        rec = {"step": step + 1, "loss": loss, "micro_batches": sizes, "time_s": dt,
               "samples_per_s": (step + 1) * args.global_batch / (time.perf_counter() - t_start)}
        out.append(rec)
        log(f"step {step + 1}/{args.steps} loss {loss:.4f} micro-batches {sizes} {dt * 1e3:.0f} ms "
            f"{args.global_batch / dt:,.1f} samples/s, abandoned {colo.abandoned}")
    colo.close()
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=50, choices=sorted(BLOCKS), help="ResNet depth (bottleneck blocks)")
    p.add_argument("--width", type=int, default=64, help="channels of the stem and the first stage (ResNet: 64)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--global-batch", type=int, default=128, help="samples per optimizer step")
    p.add_argument("--micro-batch", type=int, default=64, help="the largest micro-batch")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--pool", type=int, default=256, help="distinct synthetic images")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"),
                   help="bfloat16: autocast on the GPU (the CPU always runs float32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--colocate", default=None, metavar="ADDRESS", help="the arbiter's socket path or host:port")
    p.add_argument("--colocate-device", type=int, default=0)
    p.add_argument("--run-ahead", type=int, default=8,
                   help="module calls the host may queue ahead of the GPU while colocated (0: unbounded)")
    return p


def main(argv=None) -> int:
    train(parser().parse_args(argv), log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
