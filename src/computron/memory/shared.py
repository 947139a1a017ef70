"""Host images in shared memory: one copy of a model's image that several worker processes map.

Under the worker executor a striped swap-in has helper workers read chunks of a model's host image
(``memory/relay.py``). Rather than each helper building a copy of its own (k copies of every model in
host memory), the model's own worker builds its image in a file of ``/dev/shm`` (tmpfs: memory, not
disk) and each helper maps the same pages, read-only, the first time it helps. Torch-free: the
executor's parent names and removes the files too.

Names: ``computron-<engine pid>-<world token>-d<device>-<crc of the model name>``. The token is drawn
once per world of workers (a restarted world makes new files); the engine's pid lets the engine
remove what workers it killed left behind (``remove_images``). The owner removes its file when the
image is dropped; a helper's mapping stays valid after that (the pages go with the last mapping).
"""

from __future__ import annotations

import glob
import mmap
import os
import zlib

SHM_DIR = "/dev/shm"


def image_path(engine_pid: int, token: str, device: int, model: str) -> str:
    """The file of the host image of ``model`` held by the worker of ``device``."""
    return os.path.join(SHM_DIR, f"computron-{engine_pid}-{token}-d{device}-{zlib.crc32(model.encode()):08x}")


def create(path: str, nbytes: int) -> mmap.mmap:
    """A new shared file of ``nbytes``, mapped read-write. Its pages are allocated now
    (``posix_fallocate``), so a full ``/dev/shm`` is an error here rather than a SIGBUS when the image
    is written."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError as e:
            free = os.statvfs(SHM_DIR)
            os.unlink(path)
            raise MemoryError(f"a host image of {nbytes} bytes does not fit in {SHM_DIR} "
                              f"({free.f_bavail * free.f_frsize} bytes free): striped swap-ins under workers keep "
                              f"images there; give it more room or do without stripe_devices ({e})") from None
        return mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def attach(path: str, nbytes: int, writable: bool = False) -> mmap.mmap:
    """The shared file another worker created, mapped read-only (``writable``: read-write, for a
    driver that page-locks only writable pages; a helper still never writes)."""
    try:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(f"no shared host image at {path}: its model's worker has not built it "
                                f"(or dropped it)") from None
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"the shared host image at {path} holds {size} bytes, expected {nbytes}")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_images(engine_pid: int) -> int:
    """Remove every image file of the workers of the engine ``engine_pid`` (once they are gone: files
    of workers that were killed stay otherwise); how many were removed."""
    n = 0
    for path in glob.glob(os.path.join(SHM_DIR, f"computron-{engine_pid}-*")):
        remove(path)
        n += 1
    return n
