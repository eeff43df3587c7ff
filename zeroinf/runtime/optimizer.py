"""The optimizer side of ZeRO stages 1–3: fp32 master weights and Adam moments per sub-group.

A rank's trainable state is a list of flat fp32 *sub-groups* (at most ``sub_group_size`` elements
each). :class:`SubGroupOptimizer` holds, per sub-group, the master weights, ``exp_avg`` and
``exp_avg_sq`` in CPU memory (``device="cpu"``, pinned when an accelerator exists, or ``"none"``)
or in NVMe swap files (``device="nvme"``, through :class:`zeroinf.io.TensorSwapper`). It never sees
modules, ranks or communication: the caller hands it each sub-group's fp32 gradient (a CPU tensor)
and a flat tensor that receives the updated parameters.

Interface (kept small; stage 3 uses the same one for its unit shards)::

    opt = SubGroupOptimizer([SubGroupSpec("g0/s0", numel, param_group=0), ...],
                            device="nvme", swap_dir=..., buffer_count=4,
                            pipeline_read=True, pipeline_write=True, aio=cfg.aio)
    opt.init_master(i, fp32_values)            # once per sub-group, before the first step
                                               # (storage=flat fp32 CPU params: the master IS the param)
    opt.prefetch()                             # optional: start reading sub-group 0 (NVMe) early
    opt.step(step=t, hyper=[{"lr":..., "betas":(b1, b2), "eps":..., "weight_decay":...,
                             "adamw_mode": True, "bias_correction": True}],
             grad=lambda i: fp32_cpu_grad_i,    # numel == specs[i].numel
             out=lambda i: flat_param_i,        # fp32 | bf16 | fp16, numel == specs[i].numel, or None
             grad_scale=1.0, indices=None)      # indices: a subset, in the order to step them
    with opt.state(i) as (master, exp_avg, exp_avg_sq): ...   # read, e.g. to save a checkpoint
    opt.load_state(i, master, exp_avg, exp_avg_sq)           # write, e.g. from a checkpoint
    opt.stats                                  # OptimizerStats of the last step (s, bytes)
    opt.close()

With ``master_io`` (NVMe only), the fp32 master weights are not the optimizer's: they are the
caller's fp32 parameter partitions, which hold exactly the same values in fp32 training (stage 3,
[Note: master in the partitions] in ``zeroinf/runtime/stage3/engine_glue.py``). The swap files
then hold only ``[exp_avg | exp_avg_sq]`` (8 bytes per element instead of 12), ``out(i)`` must
be the fp32 master itself (its current values, updated in place), and ``state``/``load_state``
read and write the master through ``master_io``.

With ``state_dtype=torch.bfloat16`` the moments are stored in bf16 (the master stays fp32), in
memory and in the swap files: 8 bytes per element (4 with ``master_io``). The step reads them
exactly and writes them with stochastic rounding keyed by (sub-group key, step, element index)
(:func:`zeroinf.optim.adam_step`), so a run resumed from a checkpoint rounds exactly as the
uninterrupted run does; ``state`` yields them in bf16 and ``load_state`` takes any float dtype.

Numerics are those of :func:`zeroinf.optim.adam_step` (bit-compatible with ``torch.optim.AdamW``
up to float rounding); ``step`` is the 1-based step number used for bias correction, identical
for all sub-groups of a step.

[Note: NVMe pipelining] With one swap handle, ``wait()`` completes everything in flight, so the
loop issues, for sub-group ``i``: the write of ``i-1`` (``pipeline_write``) and the read of ``i+1``
(``pipeline_read``) *before* running Adam on ``i``, and waits after it. Reads and writes therefore
overlap the Adam compute, and at most ``1 + pipeline_read + pipeline_write`` sub-groups hold a
buffer at once (``zeroinf.config.min_optimizer_buffer_count``). Across calls: the last
sub-group's swap-out is left in flight when :meth:`step` returns (it overlaps the next forward and
backward), and :meth:`prefetch` starts the first sub-group's swap-in during the last backward;
whatever touches the state next completes them first and raises their I/O errors, :meth:`close`
included.
"""
from __future__ import annotations

import contextlib
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from .host_memory import HostMemory
from .optimizer_specs import (STATE_DTYPES, MasterIO, OptimizerStats, SubGroupSpec, optimizer_buffer_count,
                              state_bytes_per_element)

__all__ = ["MasterIO", "OptimizerStats", "SubGroupSpec", "SubGroupOptimizer", "optimizer_buffer_count",
           "state_bytes_per_element"]


@dataclass
class _Record:
    """State of one sub-group. ``state`` is (master, exp_avg, exp_avg_sq) when resident on the CPU,
    else None (on NVMe, or not initialised yet). ``buffer`` is the pinned buffer index it occupies
    while swapped in."""

    spec: SubGroupSpec
    state: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    initialised: bool = False
    buffer: Optional[int] = None
    registered: bool = False  # NVMe: its swap file exists ([Note: swap files on first write])


class SubGroupOptimizer:
    """Master weights and Adam moments for a list of sub-groups, on CPU or NVMe.

    Args:
        specs: the sub-groups, keys unique.
        device: "none" or "cpu" (state in CPU memory) or "nvme" (swap files).
        swap_dir: directory for the swap files (required for "nvme"); a private subfolder is used.
        buffer_count: pinned swap buffers for "nvme", each holding one sub-group's swapped
            tensors (:func:`state_bytes_per_element` ``* max numel`` bytes: 12, 8 with ``master_io``,
            8 and 4 with bf16 moments); at least
            ``1 + pipeline_read + pipeline_write``.
        pipeline_read / pipeline_write: overlap the next sub-group's swap-in / the previous one's
            swap-out with the current Adam compute.
        pin_memory: pin the CPU-resident state (only with CUDA present; ignored on CPU-only
            machines where page-locking buys nothing for CPU compute).
        aio: the ``aio`` config (dict or :class:`zeroinf.config.AioConfig`) for the I/O handle.
        master_io: with device "nvme", a :class:`MasterIO` over the caller's fp32 parameters,
            which are the master weights: only the moments are swapped, and ``step``'s ``out(i)``
            must return the master (fp32, contiguous, CPU), holding its current values.
        state_dtype: element type of ``exp_avg`` and ``exp_avg_sq``, torch.float32 (default) or
            torch.bfloat16 (stochastic rounding; see the module docstring).
        host: the :class:`~zeroinf.runtime.host_memory.HostMemory` the CPU-resident state and the
            swap buffer pool come from (the engine's, shared with its stage); None: a new one.

    Raises:
        ValueError: duplicate keys, a non-positive numel, an unknown device, too few buffers,
            ``master_io`` with a device other than "nvme", a ``state_dtype`` other than fp32 or bf16.
    """

    def __init__(self, specs: Sequence[SubGroupSpec], *, device: str = "cpu", swap_dir: Optional[str] = None,
                 buffer_count: int = 4, pipeline_read: bool = False, pipeline_write: bool = False,
                 pin_memory: bool = False, aio=None, master_io: Optional[MasterIO] = None,
                 state_dtype: torch.dtype = torch.float32, host: Optional[HostMemory] = None):
        keys = [s.key for s in specs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"SubGroupOptimizer: duplicate sub-group keys in {keys}")
        for s in specs:
            if s.numel <= 0:
                raise ValueError(f"SubGroupOptimizer: sub-group {s.key!r} has numel {s.numel}; must be > 0")
        if device not in ("none", "cpu", "nvme"):
            raise ValueError(f"SubGroupOptimizer: device must be none, cpu or nvme, got {device!r}")
        if master_io is not None and device != "nvme":
            raise ValueError(f"SubGroupOptimizer: master_io needs device 'nvme' (got {device!r}); CPU-resident "
                             "state takes the parameters as init_master(..., storage=...)")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"SubGroupOptimizer: state_dtype must be torch.float32 or torch.bfloat16, "
                             f"got {state_dtype}")
        self.master_io = master_io
        self.state_dtype = state_dtype
        # bytes per element in the swap files and buffers: [fp32 master |] exp_avg | exp_avg_sq
        self._elem_bytes = state_bytes_per_element(state_dtype, master=master_io is None)
        # the stochastic rounding's seed of each sub-group: fixed by its key, so the same in a resumed run
        self._seeds = [zlib.crc32(s.key.encode()) for s in specs]
        self.specs: List[SubGroupSpec] = list(specs)
        self.device = device
        self.pipeline_read, self.pipeline_write = bool(pipeline_read), bool(pipeline_write)
        self.stats = OptimizerStats()
        #: called with the error when a step fails after it stepped some sub-groups (their new
        #: weights and state are out, the rest are not): the owner refuses the torn state
        self.on_torn: Optional[Callable[[BaseException], None]] = None
        self._records = [_Record(s) for s in self.specs]
        self._pin = bool(pin_memory)
        self.host = host if host is not None else HostMemory()  # CPU-resident state: pinned with pin_memory and CUDA
        self._swapper = None
        self._buffers: List[torch.Tensor] = []
        self._pool = None
        self._tail: Optional[int] = None    # sub-group whose swap-out is still in flight after step()
        self._ahead: List[int] = []         # sub-groups whose swap-in prefetch() issued, in order
        if device in ("cpu", "nvme"):
            from zeroinf.optim.functional import load_adam_op
            load_adam_op()  # the first-use build happens at set-up, not in the first (timed) step
        if device == "nvme":
            need = 1 + self.pipeline_read + self.pipeline_write
            if buffer_count < need:
                raise ValueError(f"SubGroupOptimizer: buffer_count {buffer_count} is too small; pipeline_read="
                                 f"{self.pipeline_read}, pipeline_write={self.pipeline_write} need at least {need}")
            if swap_dir is None:
                raise ValueError("SubGroupOptimizer: swap_dir is required for device 'nvme'")
            self._open_swap(swap_dir, buffer_count, aio)

    # ------------------------------------------------------------------------------------------
    # set-up

    def _open_swap(self, swap_dir: str, buffer_count: int, aio) -> None:
        from zeroinf.io import AsyncIOHandle, TensorSwapper

        if aio is not None and not isinstance(aio, Mapping):
            aio = aio.as_dict()
        handle = AsyncIOHandle.from_config(dict(aio or {}))
        self._swapper = TensorSwapper(swap_dir, handle)
        # [Note: swap files on first write] one file per sub-group, [master | exp_avg | exp_avg_sq]
        # or [exp_avg | exp_avg_sq], allocated by the sub-group's first load_state, not here:
        # stage 3 keeps the fp32 initial values of a zeroinf.Init model in swap files until each
        # sub-group's init_master takes them, and both at once need 4 bytes per parameter more
        # disk than training. step, prefetch and state read only initialised sub-groups, whose
        # files load_state made. Stale files under these keys, and the files of keys this
        # optimizer does not have (the folder is its own), go now, reported together.
        self._swapper.discard_stale([(self._file_key(s), self._elem_bytes // 4 * s.numel, torch.float32)
                                     for s in self.specs], only_these=True)
        max_numel = max((s.numel for s in self.specs), default=1)
        count = optimizer_buffer_count(buffer_count, self.pipeline_read, self.pipeline_write, len(self.specs))
        self._pool = self.host.pool(count, self._elem_bytes * max_numel)
        self._buffers = [self._pool.acquire() for _ in range(count)]
        self._free = list(range(count))

    def _register(self, rec: _Record) -> None:
        """Allocate ``rec``'s swap file unless it exists ([Note: swap files on first write]);
        raises the swapper's AIOError (e.g. DiskFullError, naming the file) when it cannot."""
        if not rec.registered:
            self._swapper.register(self._file_key(rec.spec), self._elem_bytes // 4 * rec.spec.numel, torch.float32)
            rec.registered = True

    def _file_key(self, spec: SubGroupSpec) -> str:
        name = "adam_state" if self.master_io is None else "adam_moments"
        return f"{spec.key}/{name}" + ("_bf16" if self.state_dtype == torch.bfloat16 else "")

    def _views(self, buf_index: int, numel: int) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) in swap buffer ``buf_index``, laid out as the swap file:
        [fp32 master | exp_avg | exp_avg_sq]; master None with ``master_io``."""
        raw = self._buffers[buf_index].view(torch.uint8)
        mb = self.state_dtype.itemsize  # bytes per moment element
        master = None if self.master_io is not None else raw[:4 * numel].view(torch.float32)
        lo = 0 if self.master_io is not None else 4 * numel
        m = raw[lo:lo + mb * numel].view(self.state_dtype)
        v = raw[lo + mb * numel:lo + 2 * mb * numel].view(self.state_dtype)
        return master, m, v

    def _items(self, rec: _Record):
        raw = self._buffers[rec.buffer].view(torch.uint8)
        return [(self._file_key(rec.spec), raw[:self._elem_bytes * rec.spec.numel].view(torch.float32))]

    def _new_cpu_state(self, numel: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.host.zeros(numel, torch.float32, pin=self._pin),
                *(self.host.zeros(numel, self.state_dtype, pin=self._pin) for _ in range(2)))

    def init_master(self, index: int, values: Optional[torch.Tensor], storage: Optional[torch.Tensor] = None) -> None:
        """Set sub-group ``index``'s master weights to ``values`` (any float dtype, numel as the
        spec) and its moments to zero. With ``master_io``, ``values`` None leaves the master as
        the caller holds it (zeroes the moments only).

        ``storage``: for CPU-resident state only, a contiguous fp32 CPU tensor to hold the master
        weights in place of a copy — e.g. the model's own flat fp32 parameters, which the step then
        updates directly (no write-back copy, no second fp32 copy of the model).

        Raises:
            ValueError: a numel mismatch, or ``storage`` that is not a contiguous fp32 CPU tensor of
                that numel (or given with device "nvme").
            AIOError: with device "nvme", the swap file cannot be allocated (e.g. DiskFullError,
                naming it) or written (see :meth:`load_state`).
        """
        rec = self._records[index]
        if values is None:
            if self.master_io is None:
                raise ValueError(f"init_master: values for sub-group {rec.spec.key!r} are None; only an optimizer "
                                 "with master_io may leave the master weights to the caller")
            self.load_state(index, None, None, None)
            return
        if values.numel() != rec.spec.numel:
            raise ValueError(f"init_master: sub-group {rec.spec.key!r} has numel {rec.spec.numel}, "
                             f"values have {values.numel()}")
        if storage is not None:
            if (self.device == "nvme" or storage.dtype != torch.float32 or storage.device.type != "cpu"
                    or not storage.is_contiguous() or storage.numel() != rec.spec.numel):
                raise ValueError(f"init_master: storage for sub-group {rec.spec.key!r} must be a contiguous fp32 "
                                 f"CPU tensor of {rec.spec.numel} elements with CPU-resident state")
            rec.state = (storage.view(-1),) + self._new_cpu_state(rec.spec.numel)[1:]
        self.load_state(index, values, None, None)

    def load_state(self, index: int, master: Optional[torch.Tensor], exp_avg: Optional[torch.Tensor],
                   exp_avg_sq: Optional[torch.Tensor]) -> None:
        """Overwrite sub-group ``index``'s state (moments None → zeros). For NVMe the data is
        written to the swap files before this returns (the master through ``master_io.write``
        with ``master_io``, where None keeps the caller's master); the sub-group's file is
        allocated by its first call ([Note: swap files on first write]).

        Raises:
            ValueError: a numel mismatch, or a None master without ``master_io``.
            AIOError: with device "nvme", the swap file cannot be allocated (e.g. DiskFullError,
                naming the file) or written; the sub-group is then as initialised as before.
        """
        if master is None and self.master_io is None:
            raise ValueError(f"load_state: master of sub-group {self._records[index].spec.key!r} is None")
        rec = self._records[index]
        for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if t is not None and t.numel() != rec.spec.numel:
                raise ValueError(f"load_state: {name} of sub-group {rec.spec.key!r} has numel {t.numel()}, "
                                 f"expected {rec.spec.numel}")
        if self.device == "nvme":
            self._settle()  # a prefetched copy would be stale once this is written
            self._register(rec)
            rec.buffer = self._free.pop()
            dst = self._views(rec.buffer, rec.spec.numel)
        else:
            if rec.state is None:
                rec.state = self._new_cpu_state(rec.spec.numel)
            dst = rec.state
        try:
            for d, src in zip(dst, (master, exp_avg, exp_avg_sq)):
                if d is None:
                    continue  # master_io: written below, after the moments
                if src is None:
                    d.zero_()
                else:
                    d.copy_(src.detach().reshape(-1))
            if self.device == "nvme":
                self._swapper.swap_out(self._items(rec), async_op=False)
                self._swapper.wait()
        finally:
            if self.device == "nvme":
                self._free.append(rec.buffer)
                rec.buffer = None
        if self.master_io is not None and master is not None:
            self.master_io.write(index, master.detach().reshape(-1))
        rec.initialised = True

    @contextlib.contextmanager
    def state(self, index: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield sub-group ``index``'s (master, exp_avg, exp_avg_sq) tensors for reading: the master
        fp32, the moments of ``state_dtype``.

        For NVMe they live in a swap buffer only inside the ``with`` block (one sub-group at a
        time, so a checkpoint streams the state); do not keep references past the block. With
        ``master_io`` the master is ``master_io.read(index)``.
        """
        rec = self._records[index]
        self._check_initialised(rec)
        if self.device != "nvme":
            yield rec.state
            return
        self._settle()
        rec.buffer = self._free.pop()
        try:
            self._swapper.swap_in(self._items(rec), async_op=False)
            self._swapper.wait()
            master, m, v = self._views(rec.buffer, rec.spec.numel)
            if master is None:
                master = self.master_io.read(index)
            yield master, m, v
        finally:
            self._free.append(rec.buffer)
            rec.buffer = None

    def _settle(self, keep_ahead: bool = False) -> None:
        """Complete the I/O left in flight across calls (the last swap-out of a step, prefetches);
        free the written sub-group's buffer and, unless ``keep_ahead``, the prefetched ones.
        Raises the I/O error of a failed transfer."""
        if self._tail is None and not self._ahead:
            return
        try:
            self._swapper.wait()
        finally:
            for i in ([self._tail] + ([] if keep_ahead else self._ahead)):
                if i is not None:
                    self._free.append(self._records[i].buffer)
                    self._records[i].buffer = None
            self._tail = None
            if not keep_ahead:
                self._ahead = []

    def prefetch(self, indices: Optional[Sequence[int]] = None, *, block: bool = True) -> None:
        """Start reading the state of the first sub-groups of ``indices`` (default: all, in
        order), as many as there are swap buffers (NVMe with ``pipeline_read``), so that the
        next :meth:`step` over that order finds them there; the engine calls it before the
        backward of the last micro-batch, which then hides the reads. No-op otherwise or when
        prefetches are already in flight.

        ``block=False`` never waits: the last step's swap-out, if still in flight, keeps its
        buffer, and the reads stop before that sub-group (its file is being written) and at the
        buffers free now. The stage-3 optimizer in backward calls it from the forward
        ([Note: optimizer reads in the forward] in stage3/in_backward.py)."""
        if self.device != "nvme" or not self.pipeline_read or self._ahead or not self._records:
            return
        order = list(range(len(self._records))) if indices is None else list(indices)
        if block:
            self._settle()  # the last step's swap-out: its buffer is free again
        elif self._tail in order:
            order = order[:order.index(self._tail)]
        for i in order[:len(self._free)]:
            rec = self._records[i]
            self._check_initialised(rec)
            rec.buffer = self._free.pop()
            self._swapper.swap_in(self._items(rec), async_op=True)
            self._ahead.append(i)

    def _check_initialised(self, rec: _Record) -> None:
        """Raise RuntimeError unless ``rec`` was written: every read of its swap file comes after
        this check, so no file is read before load_state registered it."""
        if not rec.initialised:
            raise RuntimeError(f"SubGroupOptimizer: sub-group {rec.spec.key!r} was never initialised "
                               "(call init_master or load_state first)")

    # ------------------------------------------------------------------------------------------
    # the step

    def step(self, *, step: int, hyper: Sequence[Mapping], grad: Callable[[int], torch.Tensor],
             out: Callable[[int], Optional[torch.Tensor]], grad_scale: float = 1.0,
             indices: Optional[Sequence[int]] = None, on_done: Optional[Callable[[int], None]] = None) -> None:
        """Run one Adam step over the sub-groups ``indices`` (default: all, in order).

        Args:
            step: 1-based step number after increment (bias correction), as torch uses.
            hyper: per param group: ``lr``, ``betas`` (b1, b2), ``eps``, ``weight_decay``, and
                optionally ``adamw_mode`` (default True) and ``bias_correction`` (default True).
            grad: ``grad(i)`` → the fp32 (or bf16/fp16) contiguous CPU gradient of sub-group i.
            out: ``out(i)`` → a flat tensor receiving the updated parameters (fp32, bf16 or fp16,
                any device), or None. With ``master_io``: the fp32 master itself (contiguous,
                CPU, holding the current values), updated in place.
            grad_scale: gradients are divided by it (loss scale, or loss scale / clip coefficient).
            on_done: ``on_done(i)`` runs once sub-group i's new parameters are in ``out(i)`` (its
                state's swap-out may still be in flight); the stage-3 overlapped step stores and
                releases a flat group from there.
        """
        from zeroinf.optim import adam_step

        order = list(range(len(self._records))) if indices is None else list(indices)
        st = self.stats = OptimizerStats()

        def run_adam(i: int, master, m, v) -> None:
            rec = self._records[i]
            g = grad(i)
            if g.numel() != rec.spec.numel:
                raise ValueError(f"step: gradient of sub-group {rec.spec.key!r} has numel {g.numel()}, "
                                 f"expected {rec.spec.numel}")
            h = hyper[rec.spec.param_group]
            b1, b2 = h["betas"]
            dst = out(i)
            if master is None:  # master_io: the caller's fp32 partition is the master
                if (dst is None or dst.dtype != torch.float32 or dst.device.type != "cpu"
                        or not dst.is_contiguous() or dst.numel() != rec.spec.numel):
                    raise ValueError(f"step: with master_io, out({i}) must be the fp32 master of sub-group "
                                     f"{rec.spec.key!r} (contiguous CPU fp32, {rec.spec.numel} elements), got "
                                     + ("None" if dst is None else f"{dst.dtype} {tuple(dst.shape)} on {dst.device}"))
                master = dst
            low = None
            if dst is not None and dst.dtype in (torch.bfloat16, torch.float16):
                low = dst if dst.device.type == "cpu" and dst.is_contiguous() else torch.empty(
                    rec.spec.numel, dtype=dst.dtype)
            t0 = time.perf_counter()
            adam_step(master, g, m, v, step=int(step), lr=float(h["lr"]), beta1=float(b1), beta2=float(b2),
                      eps=float(h["eps"]), weight_decay=float(h["weight_decay"]),
                      adamw_mode=bool(h.get("adamw_mode", True)), bias_correction=bool(h.get("bias_correction", True)),
                      grad_scale=float(grad_scale), params_out=low, sr_seed=self._seeds[i])
            st.adam_s += time.perf_counter() - t0
            if dst is not None:
                if low is None:
                    if dst.data_ptr() != master.data_ptr():  # not when the master is the parameter
                        dst.reshape(-1).copy_(master)
                elif low is not dst:
                    dst.reshape(-1).copy_(low)

        stepped = 0  # sub-groups whose update is out (parameters written, state changed)

        def torn(exc: BaseException) -> None:
            if stepped and self.on_torn is not None:
                self.on_torn(exc)

        if self.device != "nvme":
            try:
                for i in order:
                    rec = self._records[i]
                    self._check_initialised(rec)
                    run_adam(i, *rec.state)
                    stepped += 1
                    if on_done is not None:
                        on_done(i)
            except BaseException as exc:
                torn(exc)
                raise
            return

        swapper = self._swapper
        nbytes = lambda i: self._elem_bytes * self._records[i].spec.numel
        t0 = time.perf_counter()
        # prefetched sub-groups are used if they are this step's first ones (the loop below
        # needs a free buffer for any other read); the others are dropped
        ahead = self._ahead
        usable = len(ahead) if order[:len(ahead)] == ahead else 0
        self._settle(keep_ahead=True)
        st.io_wait_s += time.perf_counter() - t0
        loaded = set(ahead[:usable])  # read during the backward, completed by _settle
        st.bytes_read += sum(nbytes(i) for i in loaded)
        for i in ahead[usable:]:
            self._free.append(self._records[i].buffer)
            self._records[i].buffer = None
        self._ahead = []
        pending_write: Optional[int] = None

        def wait() -> None:
            t0 = time.perf_counter()
            swapper.wait()
            st.io_wait_s += time.perf_counter() - t0

        def free(i: Optional[int]) -> None:
            if i is not None:
                self._free.append(self._records[i].buffer)
                self._records[i].buffer = None

        def read(i: int) -> None:
            rec = self._records[i]
            self._check_initialised(rec)
            rec.buffer = self._free.pop()
            swapper.swap_in(self._items(rec), async_op=True)
            st.bytes_read += nbytes(i)
            loaded.add(i)

        def write(i: int) -> None:
            swapper.swap_out(self._items(self._records[i]), async_op=True)
            st.bytes_written += nbytes(i)

        try:
            for pos, i in enumerate(order):
                rec = self._records[i]
                writing = pending_write
                pending_write = None
                if writing is not None:
                    write(writing)  # the previous sub-group's swap-out overlaps this one's read/Adam
                if i not in loaded:
                    read(i)
                    wait()
                    free(writing)
                    writing = None
                if self.pipeline_read and pos + 1 < len(order) and order[pos + 1] not in loaded:
                    read(order[pos + 1])  # overlaps this sub-group's Adam
                run_adam(i, *self._views(rec.buffer, rec.spec.numel))
                stepped += 1
                if on_done is not None:
                    on_done(i)
                if self.pipeline_write:
                    pending_write = i
                else:
                    write(i)
                wait()
                free(writing)
                if not self.pipeline_write:
                    free(i)
            if pending_write is not None:
                # left in flight: it overlaps the next forward/backward, and the next call that
                # touches the state (step, prefetch, state, load_state, close) completes it first
                write(pending_write)
                self._tail = pending_write
        except BaseException as exc:
            torn(exc)
            # leave the swapper idle and every buffer free, so a failed step can be reported
            with contextlib.suppress(Exception):
                swapper.wait()
            for rec in self._records:
                if rec.buffer is not None:
                    self._free.append(rec.buffer)
                    rec.buffer = None
            self._tail, self._ahead = None, []
            raise

    # ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the swap buffers (their pinned, locked memory too) and close the swapper
        (files stay for inspection). Idempotent."""
        if self._swapper is not None:
            try:
                self._settle()
                self._swapper.wait()
            finally:
                self._buffers = []
                self._pool.close()
                self._swapper.close()
                self._swapper = None
