"""The stage-3 managers of this process (held weakly)."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, List, Optional


if TYPE_CHECKING:
    from .manager import Stage3ParameterManager


_MANAGERS: "weakref.WeakSet[Stage3ParameterManager]" = weakref.WeakSet()


def managers(include_closed: bool = False) -> List["Stage3ParameterManager"]:
    """The managers of this process whose models are still alive (for ``gathered_parameters``);
    with ``include_closed``, also those closed by ``engine.close()``, so that a caller handed
    their parameters can say so instead of ignoring them."""
    return [m for m in list(_MANAGERS) if include_closed or not m._closed]


def partitioned_by(params) -> Optional["Stage3ParameterManager"]:
    """The stage-3 manager, open or closed, whose partitions hold any of ``params`` (an
    iterable of parameters), or None. Such parameters are placeholders: ``zeroinf.initialize``
    refuses a model holding them."""
    params = list(params)
    return next((m for m in managers(include_closed=True) if any(m.slot_of(p) is not None for p in params)), None)
