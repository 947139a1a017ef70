"""Host images on 2 MiB pages (``memory/host.py``): aligned, advised to the kernel, same weights."""

import dataclasses
import gc
import mmap
import re

import pytest
import torch

from computron.memory.host import HUGE_PAGE, HUGE_PAGES_ENV, HostImage, host_buffer
from computron.memory.layout import layout_for
from computron.models import resolve_model

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="madvise(MADV_HUGEPAGE) is Linux's")


def vm_flags(addr: int) -> set[str]:
    """The kernel's flags of the mapping holding ``addr`` (``hg``: advised for huge pages)."""
    span = None
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                span = int(m.group(1), 16) <= addr < int(m.group(2), 16)
            elif span and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_huge_buffer_is_aligned_advised_and_holds_its_bytes():
    n = 5 * HUGE_PAGE + 123
    buf = host_buffer(n, pin=False, huge=True)
    gc.collect()  # the view alone keeps the mapping alive
    assert buf.numel() == n and buf.dtype == torch.uint8
    assert buf.data_ptr() % HUGE_PAGE == 0
    assert "hg" in vm_flags(buf.data_ptr())
    assert "hg" in vm_flags(buf.data_ptr() + n - 1)  # the advice covers the whole buffer
    buf.copy_(torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8))
    assert torch.equal(buf[-5:], torch.tensor([(n - 5 + i) % 251 for i in range(5)], dtype=torch.uint8))


def test_small_pages_by_default_and_huge_ones_by_environment(monkeypatch):
    cfg, _ = resolve_model("opt-125m")  # 250 MB: big enough for the allocator to map it apart
    layout = layout_for(cfg)
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    plain = HostImage(layout, pin=False)
    assert "hg" not in vm_flags(plain.buffer.data_ptr())
    monkeypatch.setenv(HUGE_PAGES_ENV, "1")
    huge = HostImage(layout, pin=False)
    assert huge.buffer.data_ptr() % HUGE_PAGE == 0 and "hg" in vm_flags(huge.buffer.data_ptr())
    assert huge.buffer.numel() == plain.buffer.numel() == layout.nbytes


def test_same_weights_on_either_page_size():
    cfg, _ = resolve_model("tiny-opt")
    cfg = dataclasses.replace(cfg, vocab_size=16384)  # over two huge pages
    layout = layout_for(cfg)
    assert layout.nbytes > 2 * HUGE_PAGE
    a, b = HostImage(layout, pin=False, huge=False), HostImage(layout, pin=False, huge=True)
    assert b.buffer.data_ptr() % HUGE_PAGE == 0
    a.fill_random(cfg, 3)
    b.fill_random(cfg, 3)
    assert a.views.keys() == b.views.keys()
    for name in a.views:
        assert torch.equal(a.views[name], b.views[name])


def test_a_small_buffer_stays_on_small_pages():
    buf = host_buffer(4096, pin=False, huge=True)  # under one huge page: nothing to gain
    assert buf.numel() == 4096


def test_a_setting_that_is_neither_on_nor_off_is_refused(monkeypatch):
    from computron.memory.host import huge_pages_default

    monkeypatch.setenv(HUGE_PAGES_ENV, "maybe")
    with pytest.raises(ValueError, match="COMPUTRON_HOST_HUGE_PAGES must be 1 or 0 .* got 'maybe'"):
        huge_pages_default()
    monkeypatch.setenv(HUGE_PAGES_ENV, "On")
    assert huge_pages_default()
