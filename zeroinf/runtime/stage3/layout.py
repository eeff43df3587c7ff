"""Stage 3 set-up: limits, staging-buffer sizes, tier stores, the initial partitioning."""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from zeroinf import progress

from .options import Stage3ConfigError
from .released import mark_released
from .tiers import DeviceStore, HostCache, HostStore, NvmeStore
from .swap_plan import unit_tiers
from .units import FlatGroup, Unit
from .reads import _IOThread


class LayoutMixin:
    """Checks the config against the units, builds the tier stores and partitions the initial values."""

    # ------------------------------------------------------------------------ set-up
    def _check_limits(self) -> None:
        opts = self.options
        #: home tier of each unit's partitions, by unit index (``offload_param.ratio``)
        self.unit_tiers = unit_tiers(self.units, opts)
        blocks = [u for u in self.units if u.index >= 2 and u.groups]
        root = self.units[1]
        biggest = max(blocks, key=lambda u: u.numel, default=None)
        need_live = root.numel + (biggest.numel if biggest else 0)
        if opts.max_live_parameters < need_live:
            # DeepSpeed reads the key as a bound on prefetching only and runs any value; here it
            # bounds every gather, so a value below what one forward needs becomes that minimum
            # (no prefetch beyond it) rather than a refusal of a config DeepSpeed runs
            who = f"the root unit ({root.numel}) plus unit '{biggest.name}' ({biggest.numel})" if biggest else "the root unit"
            warnings.warn(f"zero_optimization.stage3_max_live_parameters: {opts.max_live_parameters} elements cannot "
                          f"hold {who}; using the minimum, {need_live}", stacklevel=2)
            self.options = opts = dataclasses.replace(opts, max_live_parameters=need_live)
        if "nvme" in self.unit_tiers:
            part = max((g for u in self._nvme_units() for g in u.groups), key=lambda g: g.shard_numel, default=None)
            if part is not None and opts.buffer_size < part.shard_numel:
                name = self.units[int(part.key.split("/")[0][4:])].name
                raise Stage3ConfigError("zero_optimization.offload_param.buffer_size",
                                        f"{opts.buffer_size} elements is smaller than the partition of unit '{name}' "
                                        f"({part.key}, {part.shard_numel} elements); the minimum is {part.shard_numel}")
            need = self.min_buffer_count()
            if self.param_buffer_count() < need:
                widest = max(self._nvme_units(), key=lambda u: len(u.groups))
                why = (f"one unit read ahead plus one read on demand, {len(widest.groups)} partition(s) each "
                       f"(unit '{widest.name}')" if opts.prefetch_bucket_size > 0 else
                       f"unit '{widest.name}' reads {len(widest.groups)} partition(s) at once")
                size = -(-need * self._largest_partition_bytes() // (opts.buffer_count * self._widest_element()))
                raise Stage3ConfigError("zero_optimization.offload_param.buffer_count",
                                        f"{opts.buffer_count} is too few for {why}; the minimum is {need}, or a "
                                        f"buffer_size of at least {size} elements, whose bytes hold {need} buffers "
                                        "of the largest partition")

    def _nvme_units(self) -> List[Unit]:
        """The units whose partitions live on NVMe (:attr:`unit_tiers`)."""
        return [u for u, tier in zip(self.units, self.unit_tiers) if tier == "nvme"]

    def unit_tier(self, unit: Unit) -> str:
        """Home tier of ``unit``'s partitions: ``"none"`` (compute device), ``"cpu"`` or ``"nvme"``."""
        return self.unit_tiers[unit.index]

    def min_buffer_count(self) -> int:
        """Pinned staging buffers needed for NVMe partitions: one per partition (dtype) of the
        widest NVMe unit for reads on demand and write-backs, and with prefetch as many again for
        one unit read ahead. More buffers let NVMe reads run further ahead (see
        [Note: read-ahead])."""
        widest = max((len(u.groups) for u in self._nvme_units()), default=1) or 1
        return widest * (2 if self.options.prefetch_bucket_size > 0 else 1)

    def _widest_element(self) -> int:
        """Bytes per element of the widest parameter dtype on NVMe (4 without NVMe partitions)."""
        return max((g.dtype.itemsize for u in self._nvme_units() for g in u.groups), default=4)

    def _largest_partition_bytes(self) -> int:
        """Bytes of the largest NVMe unit partition, rounded up to 4096 (O_DIRECT)."""
        largest = max((g.shard_numel * g.dtype.itemsize for u in self._nvme_units() for g in u.groups), default=1) or 1
        return -(-largest // 4096) * 4096

    def staging_buffer_bytes(self) -> int:
        """Bytes per pinned staging buffer: ``offload_param.buffer_size`` elements of the widest
        dtype, capped at the largest unit partition (bytes, rounded up to 4096) since a buffer
        never holds more than one partition (the DeepSpeed default of 1e8 elements would
        otherwise pin ~2 GB for any model)."""
        return min(self.options.buffer_size * self._widest_element(), self._largest_partition_bytes())

    def param_buffer_count(self) -> int:
        """Staging buffers in the NVMe pool: ``offload_param.buffer_count``, raised to
        :meth:`min_buffer_count` when the pinned bytes the config allows (``buffer_count x
        buffer_size`` elements of the widest dtype) hold that many buffers of
        :meth:`staging_buffer_bytes`. A DeepSpeed config's 5 buffers of 1e8 elements then serve a
        unit of 3 partitions (frozen, decayed and not decayed parameters), which needs 6 smaller
        ones; the pool never pins more than
        the config's budget."""
        opts, need = self.options, self.min_buffer_count()
        if opts.buffer_count >= need:
            return opts.buffer_count
        budget = opts.buffer_count * opts.buffer_size * self._widest_element()
        return need if need * self.staging_buffer_bytes() <= budget else opts.buffer_count

    def _make_stores(self, swapper) -> None:
        """One store per flat group on its unit's tier (:attr:`unit_tiers`). With
        ``offload_param.device: nvme`` the swapper and the I/O thread exist even when every unit
        is resident (ratio 0): gradient partitions may still go to swap files (``grads_on_nvme``);
        the staging pool and the ``max_in_cpu`` cache exist only for NVMe partitions."""
        opts = self.options
        self._cache = None
        if opts.offload_param_device == "nvme":
            from zeroinf import io as zio  # contract B
            if swapper is None:
                d = os.path.join(opts.nvme_path, f"zeroinf_params_rank{self.rank}")
                from zeroinf.io.probe import dir_problem
                problem = dir_problem(opts.nvme_path, create=True)
                if problem is not None:
                    raise Stage3ConfigError("zero_optimization.offload_param.nvme_path",
                                            f"{opts.nvme_path!r} {problem}")
                os.makedirs(d, exist_ok=True)
                handle = zio.AsyncIOHandle.from_config(opts.aio) if opts.aio else zio.AsyncIOHandle()
                swapper = zio.TensorSwapper(d, handle)
            self._swapper = swapper
            if "nvme" in self.unit_tiers:
                self._pool = self.host.pool(self.param_buffer_count(), self.staging_buffer_bytes())
                self._cache = HostCache(opts.max_in_cpu, opts.pin_memory, self.host,
                                        on_hit=self._count_cache_hit) if opts.max_in_cpu > 0 else None
            self._io = _IOThread(1, thread_name_prefix="zeroinf-stage3-io")
        if opts.grads_on_nvme:
            # groups the optimizer does not step keep no gradient: no file (a LoRA
            # base's would be 420 GB at 70B bf16; parameters left out of model_parameters have none)
            optimized = [g for g in self.groups() if g.optimized]
            for g in progress.counting(optimized, "zeroinf: allocating gradient swap files", unit="group"):
                self._swapper.register(self._grad_key(g), g.shard_numel, torch.float32)
                if g.dtype != torch.float32:
                    self._swapper.register(self._grad_key(g, g.dtype), g.shard_numel, g.dtype)
        what = "parameter swap files" if "nvme" in self.unit_tiers else "parameter partitions"
        for u in progress.counting(self.units, f"zeroinf: allocating {what}", unit="unit"):
            tier = self.unit_tier(u)
            for g in u.groups:
                if tier == "nvme":
                    g.store = NvmeStore(self._swapper, f"rank{self.rank}/param/{g.key}", g.shard_numel, g.dtype,
                                        self._pool, self._cache)
                elif tier == "cpu":
                    g.store = HostStore(g.shard_numel, g.dtype, opts.pin_memory, self.host)
                else:
                    g.store = DeviceStore(g.shard_numel, g.dtype, self.device)

    def _count_cache_hit(self, nbytes: int) -> None:
        """An NVMe partition read served by the ``max_in_cpu`` host cache (I/O thread)."""
        self.stats.add("host_cache_hits")
        self.stats.add("bytes_host_read", nbytes)

    def _shard_range(self, g: FlatGroup) -> Tuple[int, int]:
        return self.rank * g.shard_numel, (self.rank + 1) * g.shard_numel

    def _partition_initial(self, shapes) -> None:
        """Copy each group's full values into this rank's partition, one group at a time, then
        drop the full parameter data.

        [Note: Init masters] ``zeroinf.Init`` holds values as constructed (fp32); a model cast to
        bf16/fp16 afterwards has partitions in that dtype. Rounding them would make the engine's
        fp32 master weights start rounded, so for such groups the optimizer steps this rank's
        partition is also kept in fp32 (4 bytes per partition element) until
        :meth:`take_init_master` hands it to the engine: in a swap file beside the parameters'
        when they are on NVMe (host memory then holds one partition at a time, whatever the
        model's size), else in host memory. A frozen group has no master: nothing is kept."""
        from .held import init_dtype, take_init_values
        for u in progress.counting(self.units, "zeroinf: partitioning parameters", unit="unit"):
            for g in u.groups:
                wide = g.optimized and g.dtype != torch.float32 and g.dtype.is_floating_point and any(
                    s.param in shapes and init_dtype(s.param) == torch.float32 for s in g.slots)
                flat = torch.zeros(g.padded_numel, dtype=torch.float32 if wide else g.dtype, device=self.device)
                for s in g.slots:
                    src = take_init_values(s.param) if s.param in shapes else s.param.data
                    flat[s.offset:s.offset + s.numel].copy_(src.reshape(-1))
                if self.world_size > 1:
                    dist.broadcast(flat, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                                   group=self.group)
                lo, hi = self._shard_range(g)
                if wide:
                    if self._swapper is not None:
                        key = f"rank{self.rank}/init_master/{g.key}"
                        self._swapper.register(key, g.shard_numel, torch.float32)
                        self._run_io(self._swapper.swap_out, [(key, flat[lo:hi].to("cpu"))], False)
                        self._init_masters[g.key] = key
                    else:
                        self._init_masters[g.key] = flat[lo:hi].to("cpu", copy=True)
                    flat = flat.to(g.dtype)
                self._run_io(g.store.write_from, flat[lo:hi])
                for s in g.slots:
                    s.param.ds_shape, s.param.ds_numel = s.shape, s.numel  # DeepSpeed's names
                    s.param.data = self._placeholder(g.dtype)
                    mark_released(s.param)  # [Note: released parameters]
                del flat

    def take_init_master(self, g: FlatGroup, lo: int, hi: int) -> Optional[torch.Tensor]:
        """fp32 values ``[lo, hi)`` of this rank's partition of ``g`` as ``zeroinf.Init``
        constructed them (see [Note: Init masters]), or None when the partition itself holds
        them exactly. The kept copy is dropped once ``hi`` reaches the partition's end."""
        t = self._init_masters.get(g.key)
        if t is None:
            return None
        if isinstance(t, str):  # in a swap file: read whole, once; the file goes
            key, t = t, torch.empty(g.shard_numel, dtype=torch.float32)
            self._run_io(self._take_swapped, key, t)
            self._init_masters[g.key] = t
        if hi >= g.shard_numel:
            del self._init_masters[g.key]
        return t[lo:hi].clone()

    def _take_swapped(self, key: str, out: torch.Tensor) -> None:
        """Read swap file ``key`` into ``out`` and remove it (I/O thread)."""
        self._swapper.swap_in([(key, out)], async_op=False)
        self._swapper.remove(key)

    def drop_init_masters(self) -> None:
        """Forget the fp32 values kept by [Note: Init masters] (frozen groups' are never taken),
        removing their swap files."""
        keys = [k for k in self._init_masters.values() if isinstance(k, str)]
        self._init_masters.clear()
        for key in keys:
            self._run_io(self._swapper.remove, key)

    # [Note: outside inference mode] A tensor made under torch.inference_mode is an inference
    # tensor, and torch refuses in-place updates to it outside that mode. The manager's tensors
    # outlive the call that makes them (placeholders, recycled buffers) or are filled on the I/O
    # thread, which is outside the mode: so they are made outside it (an eval forward, a
    # state_dict or a load under inference_mode made the next training forward, or the I/O
    # thread's read, raise "Inplace update to inference tensor outside InferenceMode").
    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        t = self._placeholders.get(dtype)
        if t is None:
            with torch.inference_mode(False):  # [Note: outside inference mode]
                t = self._placeholders[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return t
