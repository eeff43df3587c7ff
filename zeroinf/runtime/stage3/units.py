"""Units: the groups of parameters that are gathered and released together.

A unit is a module whose class is in the unit class list (transformer blocks), found
automatically for Hugging Face models (``_no_split_modules``) and for models holding an
``nn.ModuleList`` of same-class blocks. Every parameter outside the blocks, and every parameter
shared by two blocks, belongs to the root unit, which is gathered for the whole forward and
backward. Parameters with fewer than ``param_persistence_threshold`` elements form the
persistent unit, gathered once and kept gathered.

Each unit owns one :class:`FlatGroup` per parameter dtype (split further into frozen and
trainable parameters, and by optimizer param group, where a unit mixes them): a flat buffer of
those parameters, padded to a multiple of the world size and partitioned into equal shards.
"""
from __future__ import annotations

import collections
import enum
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from .passes import GradState

__all__ = ["UnitState", "ParamSlot", "FlatGroup", "Unit", "find_unit_modules", "build_units", "param_splitter", "FROZEN"]


class UnitState(enum.Enum):
    """Where a unit's full parameters are: released (only shards exist), fetching (a gather is
    in flight), gathered (module parameters are views into the full flat buffers)."""

    RELEASED = "released"
    FETCHING = "fetching"
    GATHERED = "gathered"


@dataclass(eq=False)
class ParamSlot:
    """The record of one managed parameter: its place in its group's flat buffer, and the
    group and unit it belongs to. ``Stage3ParameterManager.slot_of(param)`` finds it.

    Attributes:
        name: qualified name in the model (the first one, for a tied parameter).
        param: the parameter itself; while released its ``.data`` is an empty placeholder and
            its class the refusing twin of its own ([Note: released parameters]).
        offset, numel: where it lies in ``group``'s flat buffer, in elements.
        shape: its full shape (``numel`` elements), gathered or not.
        group: the :class:`FlatGroup` whose flat buffer holds it (set by the group).
        unit: the :class:`Unit` gathered and released with it (a property: its group's).
        status: the unit's :class:`UnitState` (a property).
    """

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    index: int  # position in its group's ``slots``
    #: ``param._version`` when the parameter was last pointed into (or written from) the gathered
    #: buffer: a larger one means an in-place change since ([Note: changes in a forward])
    version: int = 0
    #: times a forward's ``p.data = t`` was written into the buffer (a saved tensor of the
    #: weight from before that is refused at unpack)
    replaced: int = 0
    #: the forward read ``param.data`` since the gather (an in-place op on it moves no version)
    data_read: bool = False
    #: this rank's part of the parameter as the first such read found it, on the gathered
    #: buffer's device (None where the gathered buffer is the partition itself): what the
    #: release compares with, instead of reading the partition back from its tier
    data_seen: Optional[torch.Tensor] = None
    #: back-reference, set once when the group is built; out of repr (the group holds the slot)
    group: Optional["FlatGroup"] = field(default=None, repr=False)

    @property
    def unit(self) -> "Unit":
        """The unit gathered and released with it: its group's."""
        return self.group.unit

    @property
    def status(self) -> UnitState:
        """Where the parameter's full values are: its unit's state. ``RELEASED``: only the
        partitions hold them and the parameter refuses compute; ``FETCHING``: a gather is in
        flight, the parameter is still released; ``GATHERED``: the parameter is a view into its
        group's gathered flat buffer and computes on its plain class. The manager's
        ``gather``/``release`` move it; it is never set here."""
        return self.unit.state


@dataclass(eq=False)
class FlatGroup:
    """The flat buffer of one unit and one dtype, partitioned over ranks.

    Attributes:
        key: stable name, ``"unit<i>/<dtype>"``; also the swap-file key suffix.
        numel: elements of all parameters; ``padded_numel`` is a multiple of the world size;
            ``shard_numel = padded_numel // world_size`` is this rank's partition size.
        store: the rank's partition on its home tier (see ``tiers.py``).
        unit: the :class:`Unit` that owns it (set by the unit).
        full: the gathered flat buffer (``padded_numel`` elements) or ``None`` when released.
        grad_full: the unit's flat gradient during backward, ``None`` otherwise.
        grad_shard: fp32 CPU gradient of this rank's partition, accumulated over micro-batches;
            ``None`` means zero (its buffer is kept in ``grad_spare`` and reused).
    """

    key: str
    dtype: torch.dtype
    slots: List[ParamSlot]
    numel: int
    padded_numel: int
    shard_numel: int
    store: object = None
    full: Optional[torch.Tensor] = None
    #: ``full`` lies in a staging buffer of the NVMe pool, not in host scratch memory
    #: ([Note: staged buffers adopted] in fetch.py)
    full_in_pool: bool = False
    grad_full: Optional[torch.Tensor] = None
    grad_written: Optional[set] = None  # indices of slots whose gradient is in grad_full (the rest is garbage)
    grad_shard: Optional[torch.Tensor] = None
    grad_spare: Optional[torch.Tensor] = None  # grad_shard's buffer while no gradient is held (None)
    grad_on_nvme: bool = False  # the swap file holds this group's accumulated gradient
    grad_nvme_dtype: torch.dtype = torch.float32  # which swap file holds it ([Note: gradients on NVMe])
    grad_norm_part: Optional[float] = None  # [Note: norm while reducing] of the accumulated gradient
    partition_snapshot: Optional[torch.Tensor] = None  # this rank's partition as read for the backward (partition_copy)
    #: the optimizer steps it (its parameters are in an optimizer param group, or, without one
    #: given, require grad): only then are its gradients reduced, kept and counted in the norm
    optimized: bool = True
    unit: Optional["Unit"] = field(default=None, repr=False)  # back-reference, set once by the unit

    def __post_init__(self) -> None:
        for s in self.slots:
            s.group = self

    def drop_grad_shard(self) -> None:
        """Zero the accumulated gradient: ``grad_shard`` becomes None, its buffer is kept for
        the next micro-batch's copy (see [Note: first gradient copied] in reduce.py)."""
        if self.grad_shard is not None:
            self.grad_spare, self.grad_shard = self.grad_shard, None

    def new_grad_shard(self) -> torch.Tensor:
        """Make ``grad_shard`` a buffer (fp32 CPU, ``shard_numel``; contents undefined, the
        caller overwrites it whole): the kept ``grad_spare`` when there is one, else new."""
        buf = self.grad_spare if self.grad_spare is not None else torch.empty(self.shard_numel, dtype=torch.float32)
        self.grad_spare, self.grad_shard = None, buf
        return buf


@dataclass(eq=False)
class Unit:
    """A gather/release unit (see module docstring)."""

    index: int
    name: str
    module: Optional[nn.Module]
    groups: List[FlatGroup]
    persistent: bool = False
    state: UnitState = UnitState.RELEASED
    future: object = None  # the tier read in flight (FETCHING), see manager.issue
    gather_works: Optional[list] = None  # all-gather works launched ahead of use (FETCHING), [Note: all-gather ahead]
    gather_t0: float = 0.0  # when they were launched (TraceRecorder time)
    trainable: int = 0  # parameters with requires_grad
    grads_seen: int = 0  # post-accumulate hooks fired in the running backward pass (since its last reduction)
    grads_expected: int = 0  # of them, how many the graph task accumulates (manager._grads_expected)
    grad: GradState = GradState.NONE  # its gradient in the running backward pass
    reduces_this_backward: int = 0  # reductions launched in this iteration
    user_holds: int = 0  # open gathered_parameters blocks holding it gathered: no release meanwhile
    inputs_pending: int = 0  # forward calls whose input gradients the running pass has not computed yet
    in_backward: bool = False  # its backward started (manager._pre_backward) in the running pass

    def __post_init__(self) -> None:
        # the groups are fixed at construction; the scheduler reads this per trace entry
        self._numel = sum(g.padded_numel for g in self.groups)
        for g in self.groups:
            g.unit = self

    @property
    def numel(self) -> int:
        """Gathered elements (padded), the unit's share of the live-parameter count."""
        return self._numel

    @property
    def shard_numel(self) -> int:
        return sum(g.shard_numel for g in self.groups)


def exact_values(g: FlatGroup, values: Sequence[Tuple[ParamSlot, torch.Tensor]]) -> Optional[List[torch.Tensor]]:
    """``exact`` for :meth:`Stage3ParameterManager.write_group_values`: the values in fp32 (on
    the CPU) when ``g`` is bf16/fp16 and every value is fp32 or fp64 (a file's or a state dict's
    fp32 weights: the fp32 masters take them, as ``initialize`` takes a model's fp32 weights;
    they were the partition's rounding); else None, and the masters take only the
    elements whose rounded value changed (a bf16 state dict of the model itself keeps them)."""
    if g.dtype == torch.float32 or not all(v.dtype in (torch.float32, torch.float64) for _, v in values):
        return None
    return [v.detach().to("cpu", torch.float32) for _, v in values]


def _by_size(model: nn.Module, threshold: int) -> List[Tuple[str, nn.Module]]:
    """Outermost submodules with at most ``threshold`` parameter elements (and at least one);
    a larger module is split into its children, its own parameters going to the root unit."""
    out: List[Tuple[str, nn.Module]] = []

    def visit(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            full = f"{prefix}.{name}" if prefix else name
            n = sum(p.numel() for p in child.parameters())
            if n == 0:
                continue
            if n <= threshold or not any(True for _ in child.children()):
                out.append((full, child))
            else:
                visit(full, child)

    visit("", model)
    return out


def find_unit_modules(model: nn.Module, unit_classes: Optional[Sequence[str]] = None,
                      size_threshold: Optional[int] = None) -> List[Tuple[str, nn.Module]]:
    """Return ``(qualified name, module)`` of the outermost modules that form units.

    Order of choice: ``unit_classes`` (class names) if given; a Hugging Face model's
    ``_no_split_modules``; the element class of any ``nn.ModuleList`` holding two or more
    modules of one class (transformer blocks); else by size: the outermost submodules of at
    most ``size_threshold`` elements (default: an eighth of the model, so about eight units
    or more). Parameters not inside a unit belong to the root unit.

    Raises:
        ValueError: ``unit_classes`` names a class that no submodule has.
    """
    classes: Set[str]
    if unit_classes:
        classes = set(unit_classes)
        present = {type(m).__name__ for m in model.modules()}
        missing = sorted(classes - present)
        if missing:
            raise ValueError(f"stage3 unit_classes: no submodule has class {missing}; classes present: {sorted(present)}")
    else:
        classes = set(getattr(model, "_no_split_modules", None) or [])
        if not classes:
            for m in model.modules():
                if isinstance(m, nn.ModuleList) and len(m) >= 2:
                    kinds = {type(c).__name__ for c in m}
                    if len(kinds) == 1:
                        classes |= kinds
        if not classes:
            total = sum(p.numel() for p in model.parameters())
            return _by_size(model, size_threshold if size_threshold is not None else max(1, -(-total // 8)))
    out: List[Tuple[str, nn.Module]] = []
    taken: List[str] = []
    for name, m in model.named_modules():
        if m is model or type(m).__name__ not in classes:
            continue
        if any(name.startswith(t + ".") for t in taken):
            continue  # nested inside an outer unit
        taken.append(name)
        out.append((name, m))
    return out


FROZEN = "frozen"  #: the split key of parameters without requires_grad (see :func:`param_splitter`)


def _split_name(key: Hashable) -> str:
    return "frozen" if key == FROZEN else f"pg{key}"


def _groups_for(index: int, named: List[Tuple[str, nn.Parameter]], world_size: int,
                shapes: Dict[nn.Parameter, torch.Size], split: Callable[[nn.Parameter], Hashable]) -> List[FlatGroup]:
    """One flat group per (dtype, ``split(p)``) of the unit's parameters, in first-seen order.
    Keys: ``unit<i>/<dtype>`` where a dtype has one split; ``unit<i>/<dtype>/frozen`` and
    ``unit<i>/<dtype>/pg<k>`` where it has several."""
    parts: Dict[Tuple[torch.dtype, Hashable], List[Tuple[str, nn.Parameter]]] = {}
    for n, p in named:
        parts.setdefault((p.dtype, split(p)), []).append((n, p))
    per_dtype = collections.Counter(dtype for dtype, _ in parts)
    groups = []
    for (dtype, key), items in parts.items():
        slots, off = [], 0
        for n, p in items:
            shape = torch.Size(shapes.get(p, p.shape))
            slots.append(ParamSlot(n, p, off, math.prod(shape), shape, len(slots)))
            off += math.prod(shape)
        padded = int(math.ceil(off / world_size) * world_size) if off else 0
        name = f"unit{index}/{str(dtype).replace('torch.', '')}"
        if per_dtype[dtype] > 1:
            name += "/" + _split_name(key)
        groups.append(FlatGroup(key=name, dtype=dtype, slots=slots, numel=off, padded_numel=padded,
                                shard_numel=padded // world_size))
    return groups


def param_splitter(param_group_of: Optional[Dict[nn.Parameter, int]] = None) -> Callable[[nn.Parameter], Hashable]:
    """The split key that keeps a flat group within one optimizer param group and one of
    frozen / trainable: :data:`FROZEN` for a parameter without ``requires_grad`` or, when a
    map is given, one the optimizer does not train (not in ``param_group_of``); else its
    param-group index (0 without a map)."""
    if param_group_of is None:
        return lambda p: FROZEN if not p.requires_grad else 0
    return lambda p: FROZEN if not p.requires_grad else param_group_of.get(p, FROZEN)


def build_units(model: nn.Module, unit_modules: List[Tuple[str, nn.Module]], persistence_threshold: int,
                world_size: int, shapes: Optional[Dict[nn.Parameter, torch.Size]] = None,
                param_group_of: Optional[Dict[nn.Parameter, int]] = None) -> List[Unit]:
    """Assign every parameter of ``model`` to exactly one unit and lay out the flat groups.

    A unit holds one flat group per dtype, split further so that no flat group mixes frozen
    (``requires_grad=False``) and trainable parameters, or parameters of two optimizer param
    groups (``param_group_of``: parameter -> param-group index; see :func:`param_splitter`):
    each flat group's partition is then stepped with one set of hyperparameters, or not at all.

    ``shapes`` gives the true shape of parameters whose data was already partitioned away
    (``zeroinf.Init``); others use ``p.shape``. Unit 0 is the persistent unit, unit 1 the root
    unit, then one unit per entry of ``unit_modules`` (units without parameters are kept so that
    indices match modules, with no groups).
    """
    shapes = shapes or {}
    split = param_splitter(param_group_of)
    owner: Dict[nn.Parameter, List[int]] = {}
    names: Dict[nn.Parameter, str] = {}
    for ui, (mname, mod) in enumerate(unit_modules):
        for pname, p in mod.named_parameters(remove_duplicate=True):
            owner.setdefault(p, []).append(ui)
            names.setdefault(p, f"{mname}.{pname}" if mname else pname)
    per_unit: List[List[Tuple[str, nn.Parameter]]] = [[] for _ in unit_modules]
    persistent: List[Tuple[str, nn.Parameter]] = []
    root: List[Tuple[str, nn.Parameter]] = []
    for fq, p in model.named_parameters(remove_duplicate=True):
        numel = math.prod(shapes.get(p, p.shape))
        units_of = owner.get(p, [])
        if numel < persistence_threshold:
            persistent.append((fq, p))
        elif len(units_of) == 1:
            per_unit[units_of[0]].append((fq, p))
        else:  # outside every block, or shared by two blocks
            root.append((fq, p))
    units = [Unit(0, "<persistent>", None, _groups_for(0, persistent, world_size, shapes, split), persistent=True),
             Unit(1, "<root>", model, _groups_for(1, root, world_size, shapes, split))]
    for ui, (mname, mod) in enumerate(unit_modules):
        units.append(Unit(ui + 2, mname, mod, _groups_for(ui + 2, per_unit[ui], world_size, shapes, split)))
    for u in units:
        u.trainable = sum(1 for g in u.groups for s in g.slots if s.param.requires_grad)
    return units
