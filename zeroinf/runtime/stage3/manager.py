"""Stage 3 parameter manager: partitioned parameters, gathered just in time.

How one iteration runs (one rank's view):

* Root forward pre-hook: start the iteration (trace key = ``torch.is_grad_enabled()``), enter the
  saved-tensor hooks and the foreign-access mode, gather the persistent unit (if stale) and the
  root unit.
* Unit forward pre-hook: request the unit (gathered on demand, or already prefetched), then let
  the scheduler prefetch the next units of the trace. Post-hook: hook the unit's outputs for the
  backward, release the unit unless it is used again within ``stage3_max_reuse_distance``.
* Backward: a multi-grad hook on each unit call's outputs requests the unit before its backward
  runs. Each parameter's post-accumulate-grad hook copies its gradient into the unit's flat
  gradient; when all of a unit's trainable parameters have their gradient, the reduction of
  the flat gradient over ranks is launched (see [Note: asynchronous reductions]), the rank's
  shard is added to its fp32 CPU gradient buffer (accumulated over micro-batches) once it has
  completed, and the unit is released. A callback at the end of each backward pass reduces
  whatever is left (parameters that got no gradient) and releases everything; a pass of
  ``torch.autograd.grad`` reduces nothing and leaves the iteration to the backward after it
  ([Note: backward passes] in ``passes.py``).

One job per module; :class:`Stage3ParameterManager` (this file: construction, the iteration's
guards, statistics, ``close``) composes them as mixins over its shared state:

* ``layout.py``: config limits, staging-buffer sizes, tier stores, the initial partitioning;
* ``reads.py``: partitions read from their tier ([Note: I/O thread], [Note: CUDA streams]);
* ``fetch.py``: gather (``issue``, then ``_complete`` on use), release, read-ahead, foreign gathers;
* ``saved.py``: the saved-tensor hooks ([Note: saved tensors]); ``foreign.py``: the torch
  function modes ([Note: foreign access]);
* ``hooks.py``: hook installation and the forward side of an iteration;
* ``reduce.py``: the backward hooks, gradient reduction, the end of a pass and of an iteration;
* ``shards.py``: the optimizer's reads and writes of partitions and gradient shards;
* ``prefetch.py`` (the schedule), ``tiers.py`` (host pool, NVMe), ``stats.py`` (counters, trace).
"""
from __future__ import annotations

import collections
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from .options import Stage3Options
from .passes import BackwardPass, IterationPhase, UnitCall
from .overlap import StepGate
from .prefetch import PrefetchScheduler
from .stats import Stage3Stats, TraceRecorder
from .units import FlatGroup, ParamSlot, Unit, build_units, find_unit_modules
from ..host_memory import HostMemory
from ..streams import transfers_for
from .layout import LayoutMixin
from .hooks import HooksMixin
from .reads import ReadsMixin
from .fetch import FetchMixin
from .saved import SavedMixin
from .reduce import ReduceMixin
from .shards import ShardsMixin
from .foreign import _RecomputeMode
from .reads import _Staged
from .reduce import _Reduction
from .registry import _MANAGERS, managers
from .common import refreshed_master, views_its_slot  # noqa: F401 - re-exported
from .registry import partitioned_by  # noqa: F401 - re-exported

__all__ = ["Stage3ParameterManager", "managers"]


class _BusyGuard:
    """The context manager :meth:`Stage3ParameterManager.busy` returns (one per manager; re-entrant)."""

    __slots__ = ("m",)

    def __init__(self, manager: "Stage3ParameterManager"):
        self.m = manager

    def __enter__(self) -> None:
        self.m._busy += 1

    def __exit__(self, *exc) -> bool:
        self.m._busy -= 1
        return False


class Stage3ParameterManager(LayoutMixin, HooksMixin, ReadsMixin, FetchMixin, SavedMixin, ReduceMixin, ShardsMixin):
    """Partition a module's parameters over ranks and tiers; gather them just in time.

    Args:
        module: the model. Its parameters must have their full values on construction (the
            same on every rank; rank 0's are broadcast when ``world_size > 1``), or have been
            partitioned already by :class:`zeroinf.Init`.
        options: :class:`Stage3Options` (DeepSpeed ``zero_optimization`` stage-3 keys).
        device: compute device (default: CUDA if available, else CPU).
        process_group: ``torch.distributed`` group (default: the world when initialized).
        swapper: a ``zeroinf.io.TensorSwapper`` for NVMe partitions (default: one made under
            ``<nvme_path>/zeroinf_params_rank<r>``).
        unit_modules: ``(name, module)`` of the unit modules (default: :func:`find_unit_modules`).
        param_group_of: parameter -> optimizer param-group index; a unit's parameters of two
            param groups, or frozen and trainable ones, go to separate flat groups (default:
            split only frozen from trainable). A parameter that requires grad but is in none
            (``model_parameters`` a subset) is not stepped, so its gradient is not reduced,
            kept, or counted in the norm, as at stages 0-2.
        host: the :class:`~zeroinf.runtime.host_memory.HostMemory` the host partitions, the
            ``max_in_cpu`` cache, the gradient shards, the NVMe staging pool and the recycled
            scratch come from (the engine's, shared with its optimizer); None: a new one.

    Raises:
        Stage3ConfigError: ``offload_param.nvme_path`` cannot hold swap files (NVMe tier, no
            ``swapper`` given), ``offload_param.buffer_size`` is smaller than the largest unit
            partition, or ``offload_param.buffer_count`` below :meth:`min_buffer_count`; the
            message names the unit and the minimum. (``stage3_max_live_parameters`` below the root
            unit plus the largest unit is raised to that sum with a warning, as DeepSpeed runs it.)
        RuntimeError: (later) a unit module is called outside the model's forward, or a gather
            would exceed ``stage3_max_live_parameters``; ``OSError`` from the swap files.

    How an engine drives it (stage 3; ``engine_glue.py`` does this for ``ZeroEngine``):

    * construct it after building the model; call the model normally (hooks do the rest);
    * after ``loss.backward()`` the fp32 gradient of every partition is in
      ``group.grad_shard`` for ``group in manager.groups()`` (CPU, ``shard_numel`` elements,
      summed over the backward passes since :meth:`zero_grad`, averaged over ranks), or with
      ``grads_on_nvme`` in swap files (:meth:`read_grad_shard` / :meth:`write_grad_shard`);
    * step the optimizer over those shards: :meth:`read_param_shard` /
      :meth:`write_param_shard` move a partition between its home tier and a caller's tensor
      (or use ``group.store.local()`` for the device/CPU tiers), then call :meth:`params_updated`
      so the persistent unit is gathered afresh; then :meth:`zero_grad`.
    """

    def __init__(self, module: nn.Module, options: Optional[Stage3Options] = None, *,
                 device: Optional[torch.device] = None, process_group=None, swapper=None,
                 unit_modules: Optional[Sequence[Tuple[str, nn.Module]]] = None,
                 param_group_of: Optional[Dict[nn.Parameter, int]] = None, host: Optional[HostMemory] = None):
        self.options = opts = options or Stage3Options()
        self.module = module
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        self.group = process_group
        if dist.is_available() and dist.is_initialized():
            self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        else:
            self.world_size, self.rank = 1, 0
        self.stats = Stage3Stats()
        self.tracer = TraceRecorder()
        self._busy = 0  # depth of the manager's own calls in progress on this thread: see busy()
        self._busy_guard = _BusyGuard(self)
        self._in_forward_call: Optional[Tuple[int, Callable[[], None]]] = None  # call_in_forward
        self._fwd_units_done = 0  # units whose forward ran in this grad-enabled forward
        self._live = 0
        self._active: List[Unit] = []
        self._foreign: List[Unit] = []
        self._recompute_modes: List[Tuple[Unit, "_RecomputeMode"]] = []  # [Note: recompute in the backward]
        #: a gradient was reduced since the engine last looked (ZeroEngine._check_backward_ran)
        self.reduced_since_check = False
        self._phase = IterationPhase.IDLE  # [Note: backward passes] in passes.py
        self._pass: Optional[BackwardPass] = None  # the backward pass running, if any
        #: units a pass with create_graph=True used: its graph saved their parameters as they are,
        #: so they stay gathered until the iteration ends
        self._derived_holds: Set[int] = set()
        self._param_epoch = 0  # params_updated() calls so far (saved weights remember it)
        self._forwards_in_iteration = 0  # the model's own forwards in this iteration
        self._submodule_forwards = 0  # submodules' forwards called on their own in it
        self._calls: List[UnitCall] = []  # unit calls of this root forward waiting for input gradients
        self._live_calls: List[UnitCall] = []  # unit calls of this iteration a pass may still run through
        self._generation = 0  # iterations ended so far (a dropped graph's callback checks it)
        self._persistent_stale = True
        self._ctx: Optional[contextlib.ExitStack] = None
        self._entry: Optional[nn.Module] = None  # the module whose forward opened the running one
        self._graphs_alive = 0  # this iteration's forward graphs not dropped (_note_graph, _graph_dropped)
        self._placeholders: Dict[torch.dtype, torch.Tensor] = {}
        self._listeners: List[Callable[[List[FlatGroup], Dict[str, List[Tuple[int, int]]], Dict[str, torch.Tensor]],
                                       None]] = []
        self._storage_of: Dict[int, FlatGroup] = {}
        self._handles: list = []
        self._param_hooks: list = []  # the parameters' gradient hooks (see _remove_param_hooks)
        self._staged: Dict[int, _Staged] = {}
        self._grad_io: list = []  # futures of gradient accumulations on NVMe
        self.grad_norm_type: Optional[float] = None  # [Note: norm while reducing]
        # [Note: CUDA streams]: side streams and events on CUDA, plain copies on the CPU
        self.transfers = transfers_for(self.device)
        self._grads_in_flight: List[Tuple[FlatGroup, torch.Tensor, Any]] = []  # (group, pinned shard, ready)
        self._reductions: Deque[_Reduction] = collections.deque()  # [Note: asynchronous reductions], CPU
        # NCCL reduce-scatters gradients and all-gathers in place; gloo (CPU) all-reduces and all-gathers
        # into chunks (no reduce-scatter in every supported torch); see _launch_reduce and _allgather
        self._nccl = self.world_size > 1 and self.device.type == "cuda" and "nccl" in str(dist.get_backend(self.group))
        self._h2d_last: Any = None  # ready event of the last H2D copy from a CPU-tier partition
        self.step_gate = StepGate()  # [Note: overlapped step] in overlap.py
        # [Note: optimizer in backward] (in_backward.py): while set, reduced gradient partitions
        # go to this callable (group, part, ready, recycle) instead of grad_shard / the swap file
        self.grad_sink: Optional[Callable[..., None]] = None
        #: keep a copy of each partition read for the backward (partition_copy): set by the engine
        #: for the optimizer in backward when the partitions are the masters
        self.snapshot_partitions = False
        #: units still gathered when the last backward began (read in the forward and kept for the
        #: backward): with snapshot_partitions their forward reads keep the copy too
        self._held_into_backward: Set[int] = set()
        # unit-sized CPU scratch tensors, reused (take/give: no page faults); host partitions,
        # max_in_cpu cache, gradient shards (pinned with CUDA); the NVMe staging pool
        self.host = host if host is not None else HostMemory()

        from .held import init_shapes  # parameters partitioned at construction (zeroinf.Init)
        shapes = init_shapes(module)
        if unit_modules is None:
            unit_modules = find_unit_modules(module, opts.unit_classes)
        self.units: List[Unit] = build_units(module, list(unit_modules), opts.param_persistence_threshold,
                                             self.world_size, shapes, param_group_of)
        self._slots: Dict[nn.Parameter, ParamSlot] = {}  # see slot_of
        for u in self.units:
            for g in u.groups:
                g.optimized = any(s.param.requires_grad and (param_group_of is None or s.param in param_group_of)
                                  for s in g.slots)
                for s in g.slots:
                    self._slots[s.param] = s
        self._check_limits()
        # the unit buffers a step cycles through (gathered, gradient, fp32 partition copies)
        self.host.fit_units(max((g.padded_numel * max(g.dtype.itemsize, 4) for g in self.groups()), default=0))
        self._io: Optional[ThreadPoolExecutor] = None
        self._swapper = None
        self._pool = None
        self._closed = False  #: see :attr:`closed`
        #: the engine's zeroinf.runtime.engine.StateGuard (gathered_parameters refuses a half-loaded state)
        self.state_guard = None
        #: names of parameters whose data (p.data = t, not keepable: [Note: changes in a forward]) a
        #: release dropped; the engine raises on them and clears it (ZeroEngine._check_dropped_data)
        self.dropped_data: List[str] = []
        #: [Note: Init masters]: group key -> fp32 partition, or the key of its swap file
        self._init_masters: Dict[str, Union[torch.Tensor, str]] = {}
        self._make_stores(swapper)
        self._partition_initial(shapes)
        opts = self.options  # as the limit check left it
        self.scheduler = PrefetchScheduler(self, opts.prefetch_bucket_size, opts.max_live_parameters,
                                           opts.max_reuse_distance)
        self._install_hooks()
        _MANAGERS.add(self)

    @property
    def h2d_stream(self):
        """The side stream of host -> device parameter copies (``torch.cuda.Stream``), or None on
        the CPU. See [Note: CUDA streams]."""
        return self.transfers.h2d_stream

    @property
    def d2h_stream(self):
        """The side stream of device -> host gradient copies (``torch.cuda.Stream``), or None on
        the CPU. See [Note: CUDA streams]."""
        return self.transfers.d2h_stream

    def slot_of(self, param: Optional[torch.Tensor]) -> Optional[ParamSlot]:
        """The record of ``param`` (its :class:`ParamSlot`: name, full shape, place in its flat
        group, ``.group``, ``.unit``, ``.status``) when this manager partitions it; else None
        (any other tensor, or None). Matched by identity, never by value."""
        return self._slots.get(param)

    # ------------------------------------------------------------------------ forward hooks
    def busy(self) -> _BusyGuard:
        """``with manager.busy():`` marks the manager's own work (hooks, gathers, releases, the end
        of a pass). While it runs, the foreign-access and recompute modes pass every torch call
        through untouched (the manager's own ops on parameters are not a model's reads), and
        :meth:`close` refuses to run from a signal handler that interrupted it."""
        return self._busy_guard

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the tiers are gone)."""
        return self._closed

    @property
    def _in_backward(self) -> bool:
        """A backward pass runs ([Note: backward passes])."""
        return self._pass is not None

    def _check_open(self) -> None:
        """Raise RuntimeError if :meth:`close` ran: the tiers are gone."""
        if self._closed:
            raise RuntimeError("zeroinf stage 3: the engine of this model was closed (engine.close()); its "
                               "parameters are partitioned and can no longer be gathered, read or written. "
                               "Build a new engine (zeroinf.initialize) on a newly built model, and save a checkpoint "
                               "before closing to carry the state over.")

    def abort_iteration(self, keep_changes: bool = False) -> None:
        """[Note: interrupted forward] Torch runs ``always_call`` forward hooks on an
        ``Exception`` only: a ``KeyboardInterrupt`` (Ctrl-C) or ``SystemExit`` raised inside the
        forward skipped the root's post-hook, so its saved-tensor hooks and foreign-access mode
        stayed on process-wide and every unit stayed gathered; the optimizer step then updated
        the partitions under those gathered buffers, and later forwards computed on the old
        weights, silently. This closes the contexts, releases every unit and drops the
        iteration unrecorded. ``engine.forward`` calls it on such an exception; a forward of the
        model itself finds the stale context at its next root pre-hook and calls it there.
        ``engine.backward`` calls it too when the backward raised part-way: its flat gradients
        not reduced yet are dropped with the iteration (the engine drops the reduced ones).

        ``keep_changes``: the interrupted forward is the one that just ran (``engine.forward``):
        its changes to the weights of the units still gathered are kept first, as the forward's
        end would have kept them ([Note: changes in a forward]). Not for a stale forward found later, after which a step may have updated
        the partitions under the gathered copies."""
        with self.busy():
            try:
                if keep_changes and self._ctx is not None and not self._closed:
                    for u in self.units:
                        self._keep_forward_changes(u)
            finally:
                while self._recompute_modes:
                    self._recompute_modes.pop()[1].__exit__(None, None, None)
                ctx, self._ctx = self._ctx, None
                self._entry = None
                if ctx is not None:
                    ctx.close()
                self._active.clear()
                self._release_foreign()
                if self._phase is not IterationPhase.IDLE or self._pass is not None:
                    self.scheduler.abort()
                    self._end_iteration()

    def _idle(self) -> bool:
        """No forward, backward or hook of this manager is running now."""
        return self._entry is None and self._ctx is None and not self._busy and not self._in_backward

    # ------------------------------------------------------------------------ visibility
    def stats_dict(self, step: bool = False) -> Dict[str, Any]:
        """Counters of the last finished iteration, or with ``step`` of the last optimizer step
        (every micro-batch since the previous ``stats.begin_step()``; see :class:`Stage3Stats`)."""
        out = self.stats.snapshot(step=step)
        out["traces_recorded"] = self.scheduler.traces_recorded
        out["live_now"] = self._live
        out["persistent_numel"] = self.units[0].numel  # resident, not in the live counts
        return out

    def trace(self, path: "str | os.PathLike") -> int:
        """Write the last iteration's transfers and unit executions as Chrome/Perfetto JSON."""
        return self.tracer.write(path)

    def call_in_forward(self, after_units: int, fn: Optional[Callable[[], None]]) -> None:
        """Call ``fn()`` once, on the compute thread, when the next grad-enabled forward has
        run ``after_units`` units (not counting activation checkpointing's recomputes in the
        backward); ``fn=None`` cancels. One call is armed at a time: a new one replaces it. What
        ``fn`` raises propagates out of that unit's forward."""
        self._in_forward_call = None if fn is None else (max(1, int(after_units)), fn)

    def swap_files(self) -> List[str]:
        """Paths of this rank's parameter and gradient partition swap files (none in memory tiers)."""
        return [] if self._swapper is None else [str(p) for p in self._swapper.files()]

    def close(self) -> None:
        """Release everything: gathered units, the I/O thread, the swapper, the pinned (locked)
        staging buffers and the host cache; :func:`managers` no longer lists it (but with
        ``include_closed``), and a later forward or gather raises RuntimeError. Idempotent. Raises a background step's failure
        (:class:`~zeroinf.runtime.stage3.overlap.StepFailedError`) after releasing.

        Raises:
            RuntimeError: called on a thread that is inside this manager's own call and holds
                one of its locks (a signal handler that interrupted it): closing waits for the
                I/O thread, which may need that lock, and would hang for good. Nothing is closed then; set a flag in the
                handler and close after the interrupted call, as ``zeroinf train`` does.
        """
        if self._closed:
            return
        if self._busy and self._io is not None and any(
                getattr(getattr(obj, "_lock", None), "_is_owned", lambda: False)()
                for obj in (self.stats, self.tracer, self.host, self._cache, self._pool)):
            raise RuntimeError("zeroinf stage 3: engine.close() was called from inside the engine's own call on this "
                               "thread (a signal handler that interrupted it), which holds a lock the I/O thread may "
                               "need: closing here could wait for ever. Nothing was closed. Set a flag in the handler "
                               "and call engine.close() after the interrupted call returns")
        self._closed = True
        self._in_forward_call = None
        try:
            self.step_gate.wait()
        finally:
            self._remove_param_hooks()  # they hold the manager in a cycle the collector cannot see
            try:
                for u in self.units:
                    self.release(u)
                if self._io is not None:
                    self.drop_staged()
            finally:
                if self._io is not None:
                    self._io.shutdown(wait=True)
                    self._io = None
                try:
                    if self._swapper is not None and hasattr(self._swapper, "close"):
                        self._swapper.close()
                finally:
                    self._cache = None
                    if self._pool is not None:
                        self._pool.close()
                        self._pool = None
                    for g in self.groups():  # the model keeps the manager (its hooks raise "closed")
                        g.store.free()
