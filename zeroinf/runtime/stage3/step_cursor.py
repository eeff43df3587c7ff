"""The partition group a stage-3 optimizer-step driver is stepping, walked sub-group by sub-group.

Both step drivers (the overlapped step, overlap.py, and the optimizer in backward,
in_backward.py) hand the sub-optimizer ``grad(i)``, ``out(i)`` and ``on_done(i)`` over the glue's
sub-groups ``(flat group, lo, hi, param group)``; :class:`SubGroupCursor` is those three, with the
driver-specific parts (how a group's gradient and target are obtained, what follows its store)
passed in.

What holds: the sub-groups of one flat group are consecutive in the order the sub-optimizer steps
them, so a group is entered once, at its first sub-group, and finished once, at its last. The
glue builds ``_subs`` group by group (``Stage3EngineParams.__init__``) and the overlapped step
steps them in that order; the optimizer in backward steps ``sub_group_indices``, which keeps each
group's sub-groups together; and ``SubGroupOptimizer.step`` calls ``grad(i)``, ``out(i)`` and
``on_done(i)`` for one ``i`` before the next ``i`` of ``indices``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:  # annotations only
    from .manager import Stage3ParameterManager
    from .units import FlatGroup

__all__ = ["SubGroupCursor"]

# enter(g) -> (gradient partition, target partition, scratch buffer given back once g is stored
# or None); the gradient is 1-D with g.shard_numel elements, the target is where g's new
# partition is written (glue.step_target)
Enter = Callable[["FlatGroup"], Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]


class SubGroupCursor:
    """``grad``, ``out`` and ``done`` for ``SubGroupOptimizer.step`` over ``subs`` (the glue's
    ``(flat group, lo, hi, param group)`` sub-groups) stepped in the order ``order`` (indices into
    ``subs``; each group's sub-groups consecutive, see the module note).

    ``enter(g)`` is called at a group's first sub-group; at its last, ``done`` stores the target
    (``store(g, target)``), gives the scratch buffer back to ``m.host``, runs ``finished(g)``
    (the driver's gradient clean-up, if any), forgets the group and marks it done in
    ``m.step_gate``. Not thread-safe: used by the one step thread.
    """

    def __init__(self, m: "Stage3ParameterManager", subs: Sequence[Tuple["FlatGroup", int, int, int]],
                 order: Sequence[int], *, enter: Enter, store: Callable[["FlatGroup", torch.Tensor], None],
                 finished: Optional[Callable[["FlatGroup"], None]] = None):
        self._m, self._subs = m, subs
        self._enter, self._store, self._finished = enter, store, finished
        self._last = {subs[i][0].key: i for i in order}  # each group's last sub-group in the order
        self.group: Optional["FlatGroup"] = None  # the group being stepped, None between groups
        self.grad: Optional[torch.Tensor] = None  # its gradient partition (1-D, shard_numel)
        self.target: Optional[torch.Tensor] = None  # where its new partition goes
        self.scratch: Optional[torch.Tensor] = None  # a buffer of m.host to give back once stored

    def grad_of(self, i: int) -> torch.Tensor:
        """Sub-group ``i``'s gradient slice, entering its group first if it is not the current one.
        Raises RuntimeError when another group is still unfinished (the order breaks the note)."""
        g, lo, hi, _ = self._subs[i]
        if self.group is not g:
            if self.group is not None:
                raise RuntimeError(f"stage 3 step: sub-group {i} of group {g.key} comes before the last "
                                   f"sub-group of group {self.group.key}: a group's sub-groups must be consecutive")
            self.grad, self.target, self.scratch = self._enter(g)
            self.group = g
        return self.grad[lo:hi]

    def out_of(self, i: int) -> torch.Tensor:
        """Sub-group ``i``'s slice of the current group's target."""
        _g, lo, hi, _ = self._subs[i]
        return self.target[lo:hi]

    def done(self, i: int) -> None:
        """After sub-group ``i`` is stepped: when it is its group's last, finish the group."""
        g = self._subs[i][0]
        if self._last[g.key] != i:
            return
        self._store(g, self.target)
        if self.scratch is not None:
            self._m.host.give(self.scratch)
        if self._finished is not None:
            self._finished(g)
        self.group = self.grad = self.target = self.scratch = None
        self._m.step_gate.done(g.key)
