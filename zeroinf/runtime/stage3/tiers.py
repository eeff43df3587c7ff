"""Home tiers of a rank's parameter partitions: device, host (CPU) or NVMe swap file.

Every store holds one flat partition of ``numel`` elements of one dtype and offers
``read_into(dst)`` (partition -> ``dst``, returns bytes read from the tier) and
``write_from(src)`` (``src`` -> partition, returns bytes written). ``local()`` returns the
partition itself where it is an addressable tensor (device and CPU tiers) and ``None`` for NVMe.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, Optional, Set

import torch

from ..host_memory import HostMemory

__all__ = ["DeviceStore", "HostStore", "NvmeStore", "HostCache"]


class DeviceStore:
    """Partition on the compute device (``offload_param.device: none``)."""

    tier = "none"

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.numel, self.dtype = numel, dtype
        self.tensor = torch.zeros(numel, dtype=dtype, device=device)

    def local(self) -> Optional[torch.Tensor]:
        return self.tensor

    def read_into(self, dst: torch.Tensor) -> int:
        dst.copy_(self.tensor, non_blocking=True)
        return 0

    def write_from(self, src: torch.Tensor) -> int:
        self.tensor.copy_(src)
        return 0

    def free(self) -> None:
        """Drop the partition (the manager was closed)."""
        self.tensor = self.tensor.new_empty(0)


class HostStore(DeviceStore):
    """Partition in host memory (``offload_param.device: cpu``), allocated by ``host``: page-locked
    with ``pin`` and CUDA."""

    tier = "cpu"

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool, host: HostMemory):
        self.numel, self.dtype = numel, dtype
        self.tensor = host.empty(numel, dtype, pin=pin)
        self.tensor.zero_()

    def read_into(self, dst: torch.Tensor) -> int:
        dst.copy_(self.tensor, non_blocking=True)
        return self.tensor.numel() * self.tensor.element_size()

    def write_from(self, src: torch.Tensor) -> int:
        self.tensor.copy_(src)
        return self.tensor.numel() * self.tensor.element_size()


class HostCache:
    """Host copies of NVMe partitions, at most ``max_elements`` elements
    (``offload_param.max_in_cpu``). Thread-safe.

    The partitions cached first keep their place: a partition enters while there is room and
    is then updated in place by every write (no eviction, no new allocation). The units are
    read in a cycle (forward in order, backward in reverse, every step), and a least-recently-used
    cache smaller than the cycle evicts exactly the partition needed next: every read missed,
    and every write allocated (and pinned) a new copy. On the bench's 101M-parameter model with a
    quarter of it allowed, the step went from 1.32 to 2.08 s with the optimizer in backward.

    The copies are allocated by ``host`` (page-locked with ``pin`` and CUDA). ``on_hit(nbytes)``,
    if given, is called for every :meth:`get` that finds its key (a read served from host memory
    instead of NVMe), so the caller can count those bytes."""

    def __init__(self, max_elements: int, pin: bool, host: HostMemory,
                 on_hit: Optional[Callable[[int], None]] = None):
        self.max_elements, self.pin, self.host, self.on_hit = max_elements, pin, host, on_hit
        self._lock = threading.RLock()  # re-entered by close() from a signal handler
        self._entries: Dict[str, torch.Tensor] = {}  # the partitions with a place, valid or not
        self._valid: Set[str] = set()  # those whose copy holds the partition's current values
        self._used = 0

    def get(self, key: str) -> Optional[torch.Tensor]:
        with self._lock:
            t = self._entries.get(key) if key in self._valid else None
        if t is not None and self.on_hit is not None:
            self.on_hit(t.numel() * t.element_size())
        return t

    def put(self, key: str, src: torch.Tensor) -> None:
        """Cache ``src``'s values under ``key``: into its copy when it has a place, else into a
        new one when ``src`` fits in the room left; else nothing."""
        n = src.numel()
        with self._lock:
            t = self._entries.get(key)
            if t is not None and (t.numel() != n or t.dtype != src.dtype):  # another layout: start over
                del self._entries[key]
                self._valid.discard(key)
                self._used -= t.numel()
                t = None
            if t is None:
                if self._used + n > self.max_elements:
                    return
                t = self.host.empty(n, src.dtype, pin=self.pin)
                self._entries[key] = t
                self._used += n
            t.copy_(src.reshape(-1))
            self._valid.add(key)

    def discard(self, key: str) -> None:
        """Forget ``key``'s values (its partition is being rewritten); its place is kept."""
        with self._lock:
            self._valid.discard(key)

    @property
    def used_elements(self) -> int:
        return self._used


class NvmeStore:
    """Partition in an NVMe swap file, read and written in place from host tensors of its
    layout, through a pinned staging buffer otherwise.

    Args:
        swapper: a ``zeroinf.io.TensorSwapper``; the partition is registered under ``key``.
        pool: a ``zeroinf.io.PinnedBufferPool`` whose buffers hold at least one partition.
        cache: optional :class:`HostCache` (``max_in_cpu``).
    """

    tier = "nvme"

    def __init__(self, swapper, key: str, numel: int, dtype: torch.dtype, pool, cache: Optional[HostCache]):
        self.swapper, self.key, self.numel, self.dtype = swapper, key, numel, dtype
        self.pool, self.cache = pool, cache
        self.nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        swapper.register(key, numel, dtype)

    def local(self) -> Optional[torch.Tensor]:
        return None

    def free(self) -> None:
        """Nothing in memory: the swapper's files go with the swapper."""

    def _staging(self):
        buf = self.pool.acquire()
        return buf, buf.view(torch.uint8)[: self.nbytes].view(self.dtype)

    def read_raw(self, dst: torch.Tensor) -> int:
        """Read the partition straight into ``dst``, a contiguous host tensor suitable for the
        swapper (a pinned staging view); returns bytes read from NVMe (0 on a cache hit)."""
        if self.cache is not None:
            hit = self.cache.get(self.key)
            if hit is not None:
                dst.copy_(hit)
                return 0
        self.swapper.swap_in([(self.key, dst)], async_op=False)
        if self.cache is not None:
            self.cache.put(self.key, dst)
        return self.nbytes

    def read_into(self, dst: torch.Tensor) -> int:
        if self._direct(dst):
            return self.read_raw(dst)  # the cache is asked there
        if self.cache is not None:
            hit = self.cache.get(self.key)
            if hit is not None:
                dst.copy_(hit)
                return 0
        buf, view = self._staging()
        try:
            self.swapper.swap_in([(self.key, view)], async_op=False)
            dst.copy_(view)
            if self.cache is not None:
                self.cache.put(self.key, view)
        finally:
            self.pool.release(buf)
        return self.nbytes

    def _direct(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is the partition's exact host layout (CPU, contiguous, its dtype and
        size), so the swapper reads or writes it in place: the handle itself bounces a buffer
        that is not 4096-aligned, and a staging copy would be one more pass over every byte on
        the cores the compute uses."""
        return (t.device.type == "cpu" and t.dtype == self.dtype and t.numel() == self.numel
                and t.is_contiguous())

    def write_raw(self, src: torch.Tensor) -> int:
        """Write ``src``, a pinned staging view of the partition's size, straight to the swap
        file (no copy); returns bytes written. The cached copy is dropped first, so a failed
        write leaves no stale copy to serve later reads (they raise the swapper's error)."""
        if self.cache is not None:
            self.cache.discard(self.key)
        self.swapper.swap_out([(self.key, src)], async_op=False)
        if self.cache is not None:
            self.cache.put(self.key, src)
        return self.nbytes

    def write_from(self, src: torch.Tensor) -> int:
        """:meth:`write_raw` from any host tensor: in place when it has the partition's layout,
        else through a staging buffer (another dtype is converted there)."""
        if self._direct(src):
            return self.write_raw(src)
        buf, view = self._staging()
        try:
            view.copy_(src)
            return self.write_raw(view)
        finally:
            self.pool.release(buf)
