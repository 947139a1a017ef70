"""A colocated job's partial release on CUDA: under ``cudaMallocAsync`` the device's memory pool is
trimmed to what the job may keep, not emptied; under the native allocator the cache is emptied.
Each case runs in a child process, since the allocator backend is fixed at a process's first
allocation: `pytest -m gpu tests/gpu/test_devpool_gpu.py` on the lent GPU machine."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CHILD = r"""
import json, torch
from computron.colocate.devpool import async_backend, releaser, DevicePool
GB = 1 << 30
dev = torch.device("cuda", 0)
keep = torch.empty(GB, dtype=torch.uint8, device=dev)             # 1 GB in use: never given back
gone = [torch.empty(GB // 4, dtype=torch.uint8, device=dev) for _ in range(16)]  # 4 GB, then freed
del gone
release = releaser(dev)
out = {"async": async_backend(), "reserved_before": torch.cuda.memory_reserved(dev)}
if out["async"]:
    pool = DevicePool(0)
    out["pool_before"] = pool.reserved
    release(3 * GB)  # the job may keep 3 GB: 2 GB are given back, 2 GB stay cached
    out["pool_after"] = pool.reserved
    out["used"] = pool.used
    x = torch.empty(GB, dtype=torch.uint8, device=dev)  # a later micro-batch reuses what stayed cached
    out["pool_after_reuse"] = pool.reserved
    del x
    # blocks of mixed sizes, as a training step leaves them: CUDA's own trim stops a few MB above the mark
    mixed = [torch.empty(mb << 20, dtype=torch.uint8, device=dev) for mb in (2, 8, 16, 64, 128, 786, 3, 40) * 12]
    del mixed
    torch.cuda.synchronize()
    out["mixed_before"] = pool.reserved
    out["mixed_keep"] = out["mixed_before"] - int(2.45 * GB)
    out["mixed_after"] = pool.trim_to(out["mixed_keep"])
else:
    release(3 * GB)
    out["reserved_after"] = torch.cuda.memory_reserved(dev)
keep.fill_(1)
torch.cuda.synchronize()
print("RESULT " + json.dumps(out))
"""


def child(alloc_conf):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(next(line[7:] for line in p.stdout.splitlines() if line.startswith("RESULT ")))


def test_under_cuda_malloc_async_the_pool_is_trimmed_to_what_the_job_keeps():
    GB = 1 << 30
    got = child("backend:cudaMallocAsync")
    assert got["async"] is True
    assert got["pool_before"] >= 5 * GB  # 1 GB in use and 4 GB cached
    assert got["used"] == GB
    assert 3 * GB - GB // 4 <= got["pool_after"] <= 3 * GB  # given back down to 3 GB (in whole blocks), no further
    assert got["pool_after_reuse"] <= got["pool_after"] + 64 * (1 << 20)  # the next 1 GB came from the cache
    assert got["mixed_keep"] - GB // 4 <= got["mixed_after"] <= got["mixed_keep"]


def test_under_the_native_allocator_the_whole_cache_is_emptied():
    got = child(None)
    assert got["async"] is False
    assert got["reserved_before"] >= 5 * (1 << 30)
    assert got["reserved_after"] == 1 << 30  # only what is in use stays
