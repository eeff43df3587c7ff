"""Recycled host scratch (``HostMemory.take`` / ``give``): huge-page buffers and a free budget
that fits the units a step cycles through. References: the kernel's own view of the mappings
(/proc/self/smaps) and counts of fresh allocations."""
import copy

import pytest
import torch

from zeroinf.io.pool import HUGE_PAGE
from zeroinf.runtime.host_memory import HostMemory
from zeroinf.runtime.stage3 import Stage3Options, Stage3ParameterManager

from stage3_models import TinyLM, batch, loss_fn


def _mapping_of(addr: int):
    """(start, end, VmFlags) of the mapping of this process holding ``addr``, or None."""
    start = end = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                start, end = (lo, hi) if lo <= addr < hi else (None, None)
            elif line.startswith("VmFlags:") and start is not None:
                return start, end, line.split()[1:]
    return None


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_a_scratch_buffer_of_a_huge_page_or_more_is_aligned_advised_and_unmapped_when_freed():
    h = HostMemory()
    t = h.take(3 * HUGE_PAGE // 4 + 5, torch.float32)  # 6 MiB + 20 bytes
    assert t.data_ptr() % HUGE_PAGE == 0 and t.numel() == 3 * HUGE_PAGE // 4 + 5 and t.is_contiguous()
    t.fill_(2.5)
    start, end, flags = _mapping_of(t.data_ptr())
    assert "hg" in flags  # MADV_HUGEPAGE: the kernel backs it with transparent huge pages
    assert end - start >= t.numel() * 4 // HUGE_PAGE * HUGE_PAGE  # the advised whole huge pages
    small = h.take(1000, torch.float32)  # below a huge page: an ordinary 4096-aligned allocation
    assert small.data_ptr() % 4096 == 0
    addr = t.data_ptr()
    del t
    assert _mapping_of(addr) is None or _mapping_of(addr)[0] != start  # the mapping went with its tensor


def test_fit_units_lets_keep_buffers_of_the_unit_size_stay_free_up_to_an_eighth_of_ram():
    import psutil
    h = HostMemory(keep=3, max_free_bytes=4096)
    h.fit_units(1 << 20)
    assert h.max_free_bytes == 4096 + (3 << 20)
    bufs = [h.take(1 << 18, torch.float32) for _ in range(4)]  # 1 MiB each
    for b in bufs:
        h.give(b)
    assert h.free_bytes == 3 << 20  # keep=3 of them, all within the budget now
    h.fit_units(1 << 10)  # never lowers it
    assert h.max_free_bytes == 4096 + (3 << 20)
    h.fit_units(1 << 62)
    assert h.max_free_bytes == psutil.virtual_memory().total // 8


def test_stage3_allocates_no_unit_buffer_afresh_once_its_iterations_repeat(tmp_path, monkeypatch):
    """A manager given a scratch budget smaller than its units raises it to hold ``keep`` of
    them: once the iterations repeat (the recorded trace prefetching) every gather, gradient and read buffer is a reused one (they
    were dropped and allocated afresh, page faults and zero fill included, every step)."""
    fresh = []
    take = HostMemory.take

    def counting(self, numel, dtype, device=None):
        with self._lock:
            hit = bool(self._free.get((numel, dtype)))
        if not hit:
            fresh.append(numel)
        return take(self, numel, dtype, device)
    monkeypatch.setattr(HostMemory, "take", counting)
    ref = TinyLM()
    model = copy.deepcopy(ref)
    host = HostMemory(keep=16, max_free_bytes=2 * 2080 * 4)  # room for two of the blocks' 2080-float buffers
    opts = Stage3Options(param_persistence_threshold=20, offload_param_device="nvme", nvme_path=str(tmp_path),
                         buffer_count=4, buffer_size=4096, max_in_cpu=0)
    mgr = Stage3ParameterManager(model, opts, host=host)
    for seed in range(4):
        if seed == 2:  # the second iteration is the first with the recorded trace's prefetch
            fresh.clear()
        x, y = batch(seed)
        loss_fn(model(x), y).backward()
        loss_fn(ref(x), y).backward()
    assert fresh == []
    mgr.close()
