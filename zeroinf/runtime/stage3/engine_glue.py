"""Stage 3 behind the engine's stage interface (``zeroinf/runtime/stage_api.py``).

The engine owns the optimizer (part 1's ``SubGroupOptimizer``); this adapter exposes the rank's
unit partitions to it as sub-groups: each flat group's partition is cut into sub-groups of at most
``sub_group_size`` elements, keyed ``u<unit>/<dtype>/s<k>`` (stable across runs of one model and
config). Gradients are reduced by the manager's backward hooks unit by unit; ``reduce_gradients``
only reports what moved.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..grad_norm import combine, norm_part
from ..stage_api import StageParamsBase
from .manager import Stage3ParameterManager, refreshed_master
from .options import Stage3Options
from .overlap import run_overlapped_step
from .state_dict import ModuleStateHooks
from .swap_plan import all_fp32, grads_on_nvme, group_index, master_in_partitions, swap_file_bytes
from .units import FlatGroup

__all__ = ["engine_manager", "master_in_partitions", "swap_file_bytes", "Stage3EngineParams"]


@dataclass
class _LayoutGroup:
    """What ``zeroinf.checkpoint`` records of a flat group."""

    padded: int
    part_numel: int
    params: list
    offsets: list
    shapes: list
    sub_keys: list


def engine_manager(model: torch.nn.Module, cfg, groups: Sequence[Sequence[torch.nn.Parameter]], *,
                   rank: int = 0, world_size: int = 1, host=None) -> "Stage3EngineParams":
    """Build the stage-3 parameter manager for ``ZeroEngine`` (``zero_optimization.stage == 3``).

    Args:
        model: the module (already cast to the training dtype).
        cfg: the parsed :class:`zeroinf.config.ZeroInfConfig`.
        groups: trainable parameters of each optimizer param group.
        host: the engine's :class:`~zeroinf.runtime.host_memory.HostMemory` (None: a new one).
    """
    _refuse_compiled(model)
    from .held import check_placeholders
    check_placeholders(model.parameters())  # before any value is taken
    opts = Stage3Options.from_zero_config(cfg.zero_optimization, cfg.aio.as_dict())
    if grads_on_nvme(cfg):
        opts = dataclasses.replace(opts, grads_on_nvme=True)  # ZeRO-Infinity: host memory flat in model size
    glue = Stage3EngineParams(model, opts, groups, sub_group_size=cfg.zero_optimization.sub_group_size,
                              master_in_partitions=master_in_partitions(cfg), host=host)
    glue.saves_16bit_model = cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save
    # the optimizer in backward takes NVMe masters from copies made as the backward's reads land
    glue.manager.snapshot_partitions = (glue.master_in_partitions and cfg.zeroinf.optimizer_in_backward
                                        and cfg.zero_optimization.offload_param.device == "nvme")
    _refuse_resize_after_partitioning(model)
    return glue


def _refuse_compiled(model: torch.nn.Module) -> None:
    """Raise NotImplementedError naming a module compiled with ``torch.compile`` (wrapped, or
    ``module.compile()`` in place) before anything is partitioned: dynamo reads every parameter
    of the module it compiles when the compiled call starts, before the stage-3 hooks gather
    them, and failed there with an InternalTorchDynamoError at the first forward."""
    from torch._dynamo.eval_frame import OptimizedModule

    for name, mod in model.named_modules():
        if isinstance(mod, OptimizedModule) or getattr(mod, "_compiled_call_impl", None) is not None:
            raise NotImplementedError(
                f"zeroinf stage 3: module '{name or '<root>'}' ({type(mod).__name__}) is compiled with torch.compile, "
                "which stage 3 does not support: dynamo reads the module's parameters before the stage-3 hooks "
                "gather them. Give zeroinf.initialize the module before torch.compile, or use stages 0-2, which "
                "keep whole parameters and work with torch.compile")


def _refuse_resize_after_partitioning(model: torch.nn.Module) -> None:
    """A Hugging Face model's ``resize_token_embeddings`` after its embedding was partitioned
    read the placeholder's shape and failed in transformers with "not enough values to unpack
    (expected 2, got 1)". The partitions keep the shapes they were laid out with, so a resize
    now raises a RuntimeError saying to resize before ``zeroinf.initialize``; a call that keeps
    the row count (``resize_token_embeddings(len(tokenizer))`` on a model that has it already)
    returns the input embedding, as transformers does, and changes nothing."""
    for mod in model.modules():  # a wrapper's Hugging Face model too
        if callable(getattr(mod, "resize_token_embeddings", None)) and callable(
                getattr(mod, "get_input_embeddings", None)):
            _guard_resize(mod)


def _guard_resize(model: torch.nn.Module) -> None:
    """Put :func:`_refuse_resize_after_partitioning`'s ``resize_token_embeddings`` on ``model``."""

    def resize_token_embeddings(new_num_tokens=None, pad_to_multiple_of=None, *args, **kwargs):
        emb = model.get_input_embeddings()
        rows = int(getattr(emb.weight, "ds_shape", emb.weight.shape)[0])
        want = rows if new_num_tokens is None else int(new_num_tokens)
        if pad_to_multiple_of:
            want = -(-want // int(pad_to_multiple_of)) * int(pad_to_multiple_of)
        if want == rows:
            return emb
        raise RuntimeError(f"zeroinf stage 3: resize_token_embeddings({new_num_tokens}) after zeroinf.initialize: the "
                           f"embedding ({rows} rows) is partitioned with the shape it had then, and a partition keeps "
                           "its shape. Nothing was changed. Resize before zeroinf.initialize (for a model built "
                           "under zeroinf.Init: inside the with block, or inside zeroinf.gathered_parameters(..., "
                           "modifier_rank=0) of both embeddings before initialize)")
    model.resize_token_embeddings = resize_token_embeddings


class _PartitionMaster:
    """``SubGroupOptimizer``'s ``master_io`` over the rank's fp32 partitions: sub-group ``i``'s
    master weights are elements ``[lo, hi)`` of its flat group's partition."""

    def __init__(self, glue: "Stage3EngineParams"):
        self.glue = glue

    def read(self, index: int) -> torch.Tensor:
        """A copy of sub-group ``index``'s master (fp32, CPU): the partition read from its tier."""
        g, lo, hi, _ = self.glue._subs[index]
        return self.glue.manager.param_shard(g)[lo:hi].to("cpu", copy=True)

    def write(self, index: int, values: torch.Tensor) -> None:
        """Write ``values`` into the partition (and a gathered copy) before returning."""
        g, lo, hi, _ = self.glue._subs[index]
        self.glue.manager.write_partition_slice(g, lo, values.to(torch.float32).reshape(-1))


class Stage3EngineParams(StageParamsBase):
    """The engine's stage interface (:class:`zeroinf.runtime.stage_api.StageParams`) over a
    :class:`Stage3ParameterManager` (attribute ``manager``).

    Flat groups are laid out per optimizer param group and apart from frozen parameters
    (``build_units``' ``param_group_of``), so each sub-group is stepped with one param group's
    hyperparameters. ``master_in_partitions`` (:func:`master_in_partitions` of the config):
    the partitions are the optimizer's fp32 masters when, besides, every trainable flat group is
    fp32 (attribute ``master_in_partitions``; [Note: master in the partitions]). ``host``: the
    manager's :class:`~zeroinf.runtime.host_memory.HostMemory` (None: a new one).

    Raises:
        RuntimeError: a flat group mixes param groups or frozen and trainable parameters after
            all (``requires_grad`` changed while the manager was being built).
    """

    params_may_be_masters = False  # the optimizer's masters are its own, or the partitions (master_io)
    reduces_during_backward = True  # each unit's gradient, as its backward ends (reduce.py)
    overlaps_step = True  # [Note: overlapped step] in overlap.py
    saves_16bit_model = False  # zero_optimization.stage3_gather_16bit_weights_on_model_save (engine_manager)

    def __init__(self, model: torch.nn.Module, options: Stage3Options,
                 groups: Sequence[Sequence[torch.nn.Parameter]], *, sub_group_size: int,
                 master_in_partitions: bool = False, host=None):
        group_of = group_index(groups)
        self.manager = m = Stage3ParameterManager(model, options, param_group_of=group_of, host=host)
        #: the compute device (the manager's: CUDA when available): ``engine.device``, and where the
        #: gradient-norm all-reduce runs (NCCL reduces CUDA tensors only)
        self.device = m.device
        self.nparts = m.world_size
        self._subs: List[Tuple[FlatGroup, int, int, int]] = []  # (group, lo, hi, param group)
        self._keys: List[str] = []
        for g in m.groups():
            gis = {group_of.get(s.param) for s in g.slots}
            if gis == {None}:
                continue  # frozen
            if len(gis) > 1:  # only a parameter frozen or unfrozen between layout and here
                names = [s.name for s in g.slots]
                raise RuntimeError(f"stage 3: flat group {g.key} ({names[:3]}...) mixes optimizer param groups or "
                                   f"frozen and trainable parameters {sorted(map(str, gis))}: requires_grad changed "
                                   "after the stage-3 layout was made; set it before zeroinf.initialize")
            gi = gis.pop()
            for k, lo in enumerate(range(0, g.shard_numel, sub_group_size)):
                self._subs.append((g, lo, min(g.shard_numel, lo + sub_group_size), gi))
                self._keys.append(f"{g.key}/s{k}")
        self._staged: Optional[Tuple[FlatGroup, torch.Tensor]] = None
        self._init_read: Optional[Tuple[FlatGroup, torch.Tensor]] = None  # master_init's partition
        self._worker = None  # the background optimizer step's thread ([Note: overlapped step])
        self._bwd_step = None  # the step run inside the backward ([Note: optimizer in backward])
        self._bwd_order: List[str] = []  # flat-group keys in the order the last backward reduced them
        self.group_by_key = {g.key: g for g in m.groups()}
        # [Note: gradient cache] With gradient partitions on NVMe, grad(i) reads its flat group's
        # partition into one host tensor. The engine may change it in place (clipping) and
        # calls grad(i) again inside the optimizer step, so the tensor is written back when
        # grad() moves to another group, unless param_target() showed the optimizer consumed it.
        self._grad_cache: Optional[List[Any]] = None  # [group, tensor, write back?]
        self.state_hooks = ModuleStateHooks(model, m)  # [Note: module state dict]
        self.master_in_partitions = master_in_partitions and all_fp32(g for g, *_ in self._subs)

    # [Note: master in the partitions] In fp32 training the optimizer's master weights hold the
    # same values as the parameter partitions: each step writes the new fp32 values into both.
    # With the optimizer state on NVMe that is a second 4-byte-per-parameter copy read and
    # written every step (on the 101M bench model 0.4 GB each way, a quarter of the in-backward
    # step's NVMe bytes). So when training is fp32, the optimizer state is on NVMe and the
    # partitions live in host memory (offload_param cpu) or on NVMe, the partition is the master:
    # the optimizer's swap files hold only exp_avg and exp_avg_sq, and its step updates, in place,
    # a tensor holding the partition's current values (``step_target``): the host partition
    # itself (cpu), or a copy read from NVMe ahead of the step, or (optimizer in backward) a copy
    # of the partition that the I/O thread made as the unit's read for the backward landed,
    # before any code could see the gathered buffer (``manager.partition_copy``; not a copy of the
    # gathered buffer, which forward code or backward hooks may have edited in place: stage 3
    # discards such edits). A unit held gathered from the forward has no such copy: its partition
    # is read. Checkpoints still hold
    # a master per sub-group: ``SubGroupOptimizer.state`` reads it from the partition
    # (``_PartitionMaster``). DeepSpeed 0.19.8 writes both copies (its NVMe row in
    # bench/stage3_step.py: 2.02 GB per step, as this engine did before).
    def master_io(self) -> Optional["_PartitionMaster"]:
        """The ``SubGroupOptimizer`` ``master_io`` over this rank's partitions when they are the
        fp32 master weights ([Note: master in the partitions]), else None."""
        return _PartitionMaster(self) if self.master_in_partitions else None

    # --- the seam -------------------------------------------------------------------------
    def sub_group_specs(self):
        from zeroinf.runtime.optimizer import SubGroupSpec
        return [SubGroupSpec(k, hi - lo, gi) for k, (g, lo, hi, gi) in zip(self._keys, self._subs)]

    def master_init(self, i: int, fp32_params: Optional[Dict[int, torch.Tensor]] = None) -> torch.Tensor:
        """fp32 initial values of sub-group ``i``: the fp32 values of a model built under
        ``zeroinf.Init`` and cast afterwards (kept by the manager), else the partition overlaid
        with the fp32 copies taken before a cast (``fp32_params``: id(param) -> tensor, the
        engine's map)."""
        g, lo, hi, _ = self._subs[i]
        out = self.manager.take_init_master(g, lo, hi)  # zeroinf.Init values before a bf16/fp16 cast
        if out is not None:
            return out
        c = self._init_read  # a group's partition is read once for all its sub-groups
        if c is None or c[0] is not g:
            c = self._init_read = (g, self.manager.param_shard(g))
        out = c[1][lo:hi].to(device="cpu", dtype=torch.float32, copy=True)
        if i + 1 == len(self._subs) or self._subs[i + 1][0] is not g:
            self._init_read = None
        if fp32_params:
            base = self.manager.rank * g.shard_numel + lo  # flat offset of out[0]
            for s in g.slots:
                src = fp32_params.get(id(s.param))
                a, b = max(base, s.offset), min(base + (hi - lo), s.offset + s.numel)
                if src is not None and src.numel() == s.numel and a < b:
                    out[a - base:b - base].copy_(src.reshape(-1)[a - s.offset:b - s.offset])
        return out

    def reduce_gradients(self) -> int:
        """Gradients were reduced by the backward hooks; returns elements communicated."""
        return int(self.manager.stats.last.get("elements_reduce", 0))

    def grad(self, i: int) -> torch.Tensor:
        """This rank's accumulated fp32 gradient of sub-group ``i`` (CPU; changes persist)."""
        g, lo, hi, _ = self._subs[i]
        if self.manager.options.grads_on_nvme:
            c = self._grad_cache
            if c is None or c[0] is not g:
                self._flush_grad()
                t = torch.empty(g.shard_numel, dtype=torch.float32)
                self.manager.read_grad_shard(g, t)
                self._grad_cache = c = [g, t, True]
            return c[1][lo:hi]
        if g.grad_shard is None:
            g.grad_shard = torch.zeros(g.shard_numel, dtype=torch.float32)
        return g.grad_shard[lo:hi]

    def _flush_grad(self, write: bool = True) -> None:
        c, self._grad_cache = self._grad_cache, None
        if c is not None and c[2] and write:
            self.manager.write_grad_shard(c[0], c[1])

    def param_target(self, i: int) -> torch.Tensor:
        """Where sub-group ``i``'s updated parameters go: the partition itself (device/CPU tier),
        or a staging tensor written to the swap file once the group's sub-groups are done."""
        g, lo, hi, _ = self._subs[i]
        if self._grad_cache is not None and self._grad_cache[0] is g:
            self._grad_cache[2] = False  # the optimizer step consumes this gradient
        local = self._steppable(g)
        if local is not None:
            return local[lo:hi]
        if self._staged is not None and self._staged[0] is not g:
            self._flush()
        if self._staged is None:
            t = self.manager.param_shard(g)
            self._staged = (g, t if g.store.local() is None else t.to("cpu", copy=True))
        return self._staged[1][lo:hi]

    def _steppable(self, g: FlatGroup) -> Optional[torch.Tensor]:
        """``g``'s partition itself when the optimizer may update it in place: a device or CPU
        tier partition, except a device (CUDA) one when the partitions are the masters ([Note:
        master in the partitions]), which the CPU Adam step needs in host memory; else None
        (the step goes through a host copy stored back with ``write_param_shard``)."""
        local = g.store.local()
        if local is None or (self.master_in_partitions and local.device.type != "cpu"):
            return None
        return local

    def _flush(self) -> None:
        if self._staged is not None:
            g, t = self._staged
            self._staged = None
            self.manager.write_param_shard(g, t)

    def gather_params(self) -> int:
        """After the step: write back the last staged partition; partitions are gathered when
        the forward needs them, so nothing is all-gathered here."""
        self._flush()
        self._flush_grad(write=False)
        self.manager.params_updated()
        return 0

    def zero_grad_acc(self) -> None:
        """At each accumulation boundary (after the step, or instead of a skipped one): drop
        the gradients and close the optimizer step's stage-3 counters (see :meth:`stats`)."""
        self._flush_grad(write=False)
        self.manager.zero_grad()
        self.manager.stats.begin_step()

    # --- the overlapped step ([Note: overlapped step] in overlap.py) -----------------------
    def start_step(self, sub_optimizer, *, step: int, hyper, grad_scale: float) -> None:
        """Start the optimizer step over every sub-group on a background thread and return.

        Flat groups are updated in forward order; each group's new partition is stored on its
        home tier, its gradient cleared, and then the group is released to the forward's
        gathers (``manager.step_gate``). ``hyper`` must be a snapshot (the caller's LR schedule
        moves on). :meth:`finish_step` joins the thread.

        Raises:
            OSError: a gradient write of the last backward failed (raised here, before starting).
        """
        m = self.manager
        self._flush()
        self._flush_grad(write=False)
        m.check_grad_io(wait=True)
        m.params_updated()  # staged reads are stale; the persistent unit is gathered afresh
        m.stats.begin_step()  # the background write-backs count in the step during which they run
        self._worker = run_overlapped_step(m, sub_optimizer, self._subs, step=step, hyper=hyper,
                                           grad_scale=grad_scale, read_master_ahead=self.read_master_ahead,
                                           step_target=self.step_target, store_stepped=self.store_stepped)

    def step_target(self, g: FlatGroup, master: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Where a background step writes group ``g``'s new partition: the partition itself on
        the device/CPU tiers, else a scratch tensor for :meth:`store_stepped`. Every element is
        written by the group's sub-groups; the old values are read only when the partition is
        the optimizer's master ([Note: master in the partitions]): then the tensor holds them,
        ``master`` when given (a copy of the partition from :meth:`read_master_ahead` or the
        hand-over), else read here."""
        local = self._steppable(g)
        if local is not None:
            # CUDA: no H2D copy from a CPU-tier partition still reads the old values (waited on
            # without clearing it: the compute thread owns _h2d_last)
            self.manager.transfers.host_wait(self.manager._h2d_last)
            return local
        if master is not None:
            return master
        t = self.manager.host.take(g.shard_numel, g.dtype)
        if self.master_in_partitions:
            if g.store.local() is not None:  # a device partition: pending in the step gate, unchanged
                t.copy_(g.store.local())
            else:
                self.manager.submit_io(self.manager.read_param_raw, g, t).result()
        return t

    def read_master_ahead(self, g: FlatGroup) -> Optional[Tuple[torch.Tensor, Any]]:
        """Start reading ``g``'s NVMe partition for the background step when it is the master
        ([Note: master in the partitions]): ``(tensor, future)``, else None."""
        if not self.master_in_partitions or g.store.local() is not None:
            return None
        m = self.manager
        t = m.host.take(g.shard_numel, g.dtype)
        return t, m.submit_io(m.read_param_raw, g, t)

    def master_copy(self, g: FlatGroup) -> Optional[torch.Tensor]:
        """At the optimizer in backward's hand-over: ``g``'s partition as read for the backward
        (``manager.partition_copy``) when it is the master and on NVMe (so the step reads
        nothing), else None."""
        if not self.master_in_partitions or g.store.local() is not None:
            return None
        return self.manager.partition_copy(g)

    def store_stepped(self, g: FlatGroup, target: torch.Tensor) -> None:
        """Store a background step's new partition of ``g`` from :meth:`step_target`'s tensor
        (NVMe: written, and kept staged when a buffer is spare, so the next gather reads no
        NVMe)."""
        if target is not self._steppable(g):
            self.manager.write_param_shard_and_stage(g, target)
            self.manager.host.give(target)  # written (synchronously) or copied: free again

    # --- the optimizer in backward ([Note: optimizer in backward] in in_backward.py) -------
    def start_backward_step(self, sub_optimizer, *, step: int, hyper, norm_type: float) -> None:
        """Arm the optimizer step for the backward about to run: each flat group is stepped on
        a background thread as soon as its gradient is reduced. ``hyper``: a snapshot.

        Raises:
            OSError: a gradient write of an earlier backward failed.
        """
        from .in_backward import BackwardStep

        m = self.manager
        self._flush()
        self._flush_grad(write=False)
        m.check_grad_io(wait=True)
        order = self._backward_order()
        # kept before it starts: an interrupt anywhere in start() finds it for abort_backward_step
        self._bwd_step = b = BackwardStep(self, sub_optimizer, step=step, hyper=hyper, norm_type=norm_type,
                                          order=order)
        b.start()
        self._worker = b.thread

    def _backward_order(self) -> List[str]:
        """Flat-group keys in the order the next backward is expected to reduce them: the last
        backward's arrival order, at first the reverse forward order."""
        keys = list(dict.fromkeys(g.key for g, _lo, _hi, _gi in self._subs))
        order = [k for k in self._bwd_order if k in keys] if self._bwd_order else []
        return order + [k for k in reversed(keys) if k not in order]

    def end_backward_step(self) -> None:
        """After autograd returned: hand the groups without a gradient over (zeros), keep
        this backward's arrival order for the next step, and arm the next step's first optimizer
        reads halfway through the next forward ([Note: optimizer reads in the forward] in
        in_backward.py)."""
        from .in_backward import sub_group_indices

        b = self._bwd_step
        b.end_backward()
        self._bwd_order = list(b.arrival)
        m, opt, indices = self.manager, b.opt, sub_group_indices(self._subs, self._backward_order())

        def read_ahead() -> None:
            if m.step_gate.idle():  # the worker returned: the optimizer state is this thread's
                opt.prefetch(indices, block=False)
        m.call_in_forward(len(m.units) // 2, read_ahead)

    def abort_backward_step(self, exc: BaseException) -> bool:
        """The backward raised ``exc``: stop the background step. Returns True when no gradient
        had been handed over (nothing was updated; the step ends without error and a new one
        may start); otherwise the step fails with ``exc`` (see :meth:`finish_step`)."""
        b, self._bwd_step = self._bwd_step, None
        return True if b is None else b.abort(exc)

    def in_backward_step(self) -> bool:
        """Whether the calling thread is inside the backward of a step run in the backward
        (a signal handler, a hook): waiting for that step there would never end."""
        b = self._bwd_step
        return b is not None and b.inside_backward()

    def backward_step_norm(self, norm_type: float) -> float:
        """This rank's gradient norm part of the step run in the backward: ``sum |g|^p`` over
        its partitions, or ``max |g|`` for inf (``local_grad_norm_parts``' formula).

        Raises:
            StepFailedError: the background step failed before every norm was known.
            RuntimeError: called inside the backward that feeds the step.
        """
        return combine(self._bwd_step.norm_parts(), norm_type)  # manager.groups() order: the synchronous step's sums

    def backward_step_done(self) -> None:
        """At engine.step(): close the stage-3 counters of the step (its write-backs that run
        after this count in the next one, as for the overlapped step)."""
        self._bwd_step = None
        self.manager.stats.begin_step()

    def finish_step(self) -> None:
        """Join the background step started by :meth:`start_step`; zero the remaining gradient
        state and note the partitions changed.

        Raises:
            StepFailedError: the step failed (``__cause__`` is the original exception).
            RuntimeError: called inside the backward that feeds a step run in the backward.
        """
        if self._bwd_step is not None:
            self._bwd_step.check_can_wait()  # inside the backward feeding it: the join never ends
        w, self._worker = getattr(self, "_worker", None), None
        if w is not None:
            w.join()
        self.manager.step_gate.wait()
        self.manager.zero_grad()

    def _grad_tensors(self):
        if not self.manager.options.grads_on_nvme:
            yield from (g.grad_shard for g in self.manager.groups() if g.grad_shard is not None)
            return
        self._flush_grad()
        for g in self.manager.groups():  # streamed: one partition in memory at a time
            t = torch.empty(g.shard_numel, dtype=torch.float32)
            self.manager.read_grad_shard(g, t)
            yield t

    def track_grad_norm(self, norm_type: float) -> None:
        """Record each gradient partition's norm part while it is reduced (gradients on NVMe),
        so :meth:`local_grad_norm_parts` need not read them back (see [Note: norm while
        reducing] in shards.py)."""
        self.manager.grad_norm_type = float(norm_type)

    def local_grad_norm_parts(self, norm_type: float) -> Tuple[float, bool]:
        if self.manager.grad_norm_type == norm_type and (self._grad_cache is None or not self._grad_cache[2]):
            parts = self.manager.grad_norm_parts()
            if parts is not None:
                return combine(parts, norm_type), True
        return combine((norm_part(v, norm_type) for v in self._grad_tensors()), norm_type), True

    def attach_optimizer(self, sub_optimizer) -> None:
        """Keep ``sub_optimizer``'s fp32 master weights in step with partitions written outside
        the step (``zeroinf.gathered_parameters(..., modifier_rank=r)``); moments are kept."""
        self.manager.drop_init_masters()  # the engine made every master already
        self._init_read = None
        self.manager.stats.clear()  # the set-up's reads (the masters) belong to no training step
        if sub_optimizer.master_io is not None:  # the partitions are the masters: nothing to follow
            return
        by_group: Dict[str, List[int]] = {}
        for i, (g, _lo, _hi, _gi) in enumerate(self._subs):
            by_group.setdefault(g.key, []).append(i)

        def resync(groups: List[FlatGroup], written: Dict[str, List[Tuple[int, int]]],
                   exact: Dict[str, torch.Tensor]) -> None:
            for g in groups:
                idx = by_group.get(g.key, [])
                if not idx:
                    continue
                shard = exact[g.key] if g.key in exact else self.manager.param_shard(g)
                for i in idx:
                    _, lo, hi, _ = self._subs[i]
                    with sub_optimizer.state(i) as (master, m, v):
                        master = refreshed_master(master, shard, lo, hi, written.get(g.key))
                        m, v = m.clone(), v.clone()
                    sub_optimizer.load_state(i, master, m, v)

        self.manager.add_write_listener(resync)

    # --- checkpoint layout, stats ---------------------------------------------------------
    @property
    def groups(self) -> List[_LayoutGroup]:
        """Trainable flat groups as ``zeroinf.checkpoint`` records them (``shapes`` and
        ``sub_keys`` let ``consolidate`` rebuild parameters from the fp32 masters)."""
        keys: Dict[str, List[str]] = {}
        for k, (g, _lo, _hi, _gi) in zip(self._keys, self._subs):
            keys.setdefault(g.key, []).append(k)
        return [_LayoutGroup(g.padded_numel, g.shard_numel, [s.param for s in g.slots],
                             [s.offset for s in g.slots], [list(s.shape) for s in g.slots], keys.get(g.key, []))
                for g in self.manager.groups() if g.key in keys]  # trainable groups only

    def stats(self) -> Dict[str, Any]:
        """Stage-3 counters of the last optimizer step: all its micro-batches' forwards and
        backwards (``iterations`` of them) and the parameter write-backs of the step."""
        return self.manager.stats_dict(step=True)

    def trace(self, path) -> int:
        """Write the last iteration's transfers and unit executions as Chrome/Perfetto JSON to
        ``path``; returns the number of events."""
        return self.manager.trace(path)

    # --- the rest of the engine's interface: the manager's iteration state ---------------------
    def set_state_guard(self, guard) -> None:
        """``gathered_parameters`` refuses a state ``guard`` (the engine's StateGuard) marks torn."""
        self.manager.state_guard = guard

    def abort_iteration(self, keep_changes: bool = False) -> None:
        """Release what an interrupted forward or backward left gathered
        (:meth:`Stage3ParameterManager.abort_iteration`)."""
        self.manager.abort_iteration(keep_changes=keep_changes)

    def forget_raised_pass(self) -> None:
        """Before a backward: forget a pass that raised part-way."""
        self.manager.forget_raised_pass()

    def held_parameter_names(self) -> List[str]:
        """Names of the parameters of units a ``gathered_parameters`` block holds now."""
        return [s.name for u in self.manager.units if u.user_holds for g in u.groups for s in g.slots]

    def check_dropped_data(self) -> None:
        """RuntimeError naming parameters a forward gave data their partitions cannot take
        (:meth:`Stage3ParameterManager.check_dropped_data`)."""
        self.manager.check_dropped_data()

    def reduced_since_check(self) -> bool:
        """Whether a backward hook reduced gradients since :meth:`clear_reduced_since_check`."""
        return self.manager.reduced_since_check

    def clear_reduced_since_check(self) -> None:
        self.manager.reduced_since_check = False

    def take_step_wait_s(self) -> float:
        """Seconds the forward's gathers waited on the background step since the last call."""
        return self.manager.step_gate.take_wait_s()

    def empty_cache(self) -> int:
        """Free read-ahead partitions and scratch buffers; returns host scratch bytes freed
        (:meth:`Stage3ParameterManager.empty_cache`)."""
        return self.manager.empty_cache()

    def swap_files(self) -> List[str]:
        """Paths of the parameter (and gradient) partitions' swap files on this rank."""
        return self.manager.swap_files()

    def close(self) -> None:
        """Release the manager's buffers, threads and files (:meth:`Stage3ParameterManager.close`)."""
        self.manager.close()
