"""How a process's threads wait for its GPUs: ``COMPUTRON_CUDA_SYNC=spin|yield|blocking|auto``.

A host thread that waits for the GPU (a stream or event synchronize, a copy to the host) spins by
default in CUDA whenever the machine has more cores than active GPU contexts: it holds a core for the
whole wait. A server and a training job sharing a GPU each wait on it most of the time, so each
spins on a core the other's Python thread could use (on a machine whose cores are hyperthreads,
a sibling of the very core it runs on). ``blocking`` makes the waits sleep until the GPU is done
(a wake-up costs some microseconds); ``yield`` spins but yields the core to other threads; ``spin``
always spins; ``auto`` (or unset) leaves CUDA's choice.

The policy is a flag of each GPU's primary context, set through the driver (``libcuda``) before
the process first uses CUDA: :func:`apply` is called by ``computron serve`` (and its worker
processes) and ``computron train``. Without a driver (a CPU machine) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import os

ENV = "COMPUTRON_CUDA_SYNC"
FLAGS = {"auto": 0, "spin": 1, "yield": 2, "blocking": 4}  # CU_CTX_SCHED_*
_SCHED_MASK = 0x7


def policy(env: dict | None = None) -> str:
    """The policy ``$COMPUTRON_CUDA_SYNC`` asks for (``auto`` when unset); ValueError naming the
    variable for any other value."""
    value = (os.environ if env is None else env).get(ENV, "").strip().lower() or "auto"
    if value not in FLAGS:
        raise ValueError(f"${ENV}={value!r}: expected one of {', '.join(FLAGS)}")
    return value


def _driver():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def apply(env: dict | None = None) -> str:
    """Set every visible GPU's primary context to the policy of ``$COMPUTRON_CUDA_SYNC`` (nothing for
    ``auto``); returns a line saying what was done. Call before the process first uses CUDA."""
    name = policy(env)
    if name == "auto":
        return "CUDA waits: CUDA's default"
    lib = _driver()
    if lib is None:
        return f"CUDA waits: {ENV}={name} ignored, no CUDA driver on this machine"
    if lib.cuInit(0) != 0:
        return f"CUDA waits: {ENV}={name} ignored, the CUDA driver did not initialise"
    count = ctypes.c_int(0)
    lib.cuDeviceGetCount(ctypes.byref(count))
    set_flags = getattr(lib, "cuDevicePrimaryCtxSetFlags_v2", None) or lib.cuDevicePrimaryCtxSetFlags
    for i in range(count.value):
        dev = ctypes.c_int(0)
        rc = lib.cuDeviceGet(ctypes.byref(dev), i)
        if rc == 0:
            rc = set_flags(dev, ctypes.c_uint(FLAGS[name]))
        if rc != 0:
            raise RuntimeError(f"{ENV}={name}: the driver refused GPU {i}'s flags (CUresult {rc})")
    return f"CUDA waits: {name} on {count.value} GPU(s)"


def current(device: int = 0) -> str | None:
    """The wait policy of GPU ``device``'s primary context (``auto``, ``spin``, ``yield``, ``blocking``),
    None without a driver or device."""
    lib = _driver()
    if lib is None or lib.cuInit(0) != 0:
        return None
    dev, flags, active = ctypes.c_int(0), ctypes.c_uint(0), ctypes.c_int(0)
    if lib.cuDeviceGet(ctypes.byref(dev), device) != 0:
        return None
    if lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) != 0:
        return None
    names = {v: k for k, v in FLAGS.items()}
    return names.get(flags.value & _SCHED_MASK, f"flags {flags.value:#x}")
