"""locked_cpu_tensor / new_cpu_locked_tensor: huge-page, page-locked buffers: their layout, lock and
free, round trips through a handle, the budget checked before allocating, and the warning when
transparent huge pages are off."""
import warnings

import pytest
import torch

from zeroinf.io import AsyncIOHandle
from zeroinf.io import locked as io_locked
from aio_helpers import MiB, _bytes
from aio_helpers import backend, handle  # noqa: F401, F811 - pytest fixtures, requested by name


def _vm_flags_and_locked(addr: int):
    """(VmFlags of the mapping holding addr, VmLck bytes of the process), from /proc directly."""
    flags = None
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                flags = line.split()[1:]
    with open("/proc/self/status") as f:
        locked = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmLck:"))
    return flags, locked


@pytest.mark.parametrize("huge", [True, False], ids=["huge", "4k"])
def test_locked_tensor_layout_lock_and_free(huge):
    numel = 3 * MiB + 5  # fp32: 12 MiB + 20 bytes, so the last huge page is partly used
    nbytes = numel * 4
    step = io_locked.HUGE_PAGE if huge else 4096
    expect = -(-nbytes // step) * step
    assert io_locked.locked_cpu_tensor_bytes(numel, torch.float32, huge) == expect
    _, before = _vm_flags_and_locked(0)
    t = io_locked.locked_cpu_tensor(numel, torch.float32, huge_pages=huge)
    assert t.dtype == torch.float32 and t.shape == (numel,) and t.is_contiguous()
    assert t.data_ptr() % io_locked.HUGE_PAGE == 0
    assert not t.any()
    flags, locked = _vm_flags_and_locked(t.data_ptr())
    assert locked - before == expect
    assert ("hg" in flags) == huge  # MADV_HUGEPAGE applied exactly when asked
    assert io_locked.free_locked_cpu_tensor(t)
    assert not io_locked.free_locked_cpu_tensor(t)  # already freed
    assert not io_locked.free_locked_cpu_tensor(torch.zeros(3))  # not ours
    assert _vm_flags_and_locked(0)[1] == before
    t.fill_(1.5)  # still valid memory after free (unlocked), until dropped
    assert float(t[-1]) == 1.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("numel", [1, 257, 1_000_003], ids=["numel1", "numel257", "numel1000003"])
def test_locked_tensor_round_trip(handle, tmp_path, numel, dtype):
    src = handle.new_cpu_locked_tensor(numel, torch.empty(0, dtype=dtype))
    dst = handle.new_cpu_locked_tensor(numel, src)
    assert src.dtype == dtype and src.numel() == numel
    src.copy_(torch.randn(numel).to(dtype))
    path = tmp_path / "f.bin"
    assert handle.sync_pwrite(src, path) == 1
    assert path.read_bytes() == _bytes(src)
    handle.async_pread(dst, path)
    assert handle.wait() == 1
    assert torch.equal(dst, src)
    assert handle.is_pinned(src) and handle.is_pinned(dst[numel // 2:]) and not handle.is_pinned(torch.zeros(4))
    assert handle.free_cpu_locked_tensor(src) and handle.free_cpu_locked_tensor(dst)
    assert not handle.is_pinned(src)


def test_locked_tensor_budget_errors_before_allocating(monkeypatch):
    from zeroinf.io import PinnedMemoryError

    with pytest.raises(ValueError, match="num_elem"):
        io_locked.locked_cpu_tensor(0)
    with pytest.raises(TypeError, match="example_tensor"):
        AsyncIOHandle(backend="python").new_cpu_locked_tensor(4, torch.float32)
    monkeypatch.setattr(io_locked, "_memlock_limit", lambda: 4 * MiB)
    with pytest.raises(PinnedMemoryError, match="memlock limit"):
        io_locked.locked_cpu_tensor(4 * MiB + 1)
    monkeypatch.setattr(io_locked, "_memlock_limit", lambda: None)
    monkeypatch.setattr(io_locked, "_available_bytes", lambda: 8 * MiB)
    with pytest.raises(PinnedMemoryError, match="available memory"):
        io_locked.locked_cpu_tensor(8 * MiB + 1)


def test_locked_tensor_warns_once_when_thp_is_off(monkeypatch):
    monkeypatch.setattr(io_locked, "_thp_mode", lambda: "never")
    monkeypatch.setattr(io_locked, "_THP_WARNED", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = io_locked.locked_cpu_tensor(4096)
        b = io_locked.locked_cpu_tensor(4096)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "huge pages are disabled" in msgs[0]
    assert io_locked.free_locked_cpu_tensor(a) and io_locked.free_locked_cpu_tensor(b)
