"""A warning for a collective that some rank never joins.

``state_dict()`` of a stage-3 model, ``zeroinf.gathered_parameters`` and ``save_checkpoint`` /
``load_checkpoint`` are collectives. Called on one rank only (``if rank == 0:
torch.save(model.state_dict(), ...)``, the usual single-process habit) they wait in
torch.distributed until the process group's timeout (30 minutes by default) with nothing on
the screen, as under DeepSpeed and FSDP. :func:`collective` leaves the wait as it is and says,
after :data:`WARN_AFTER_S` seconds, what the rank is waiting in and why.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Iterator

__all__ = ["collective", "WARN_AFTER_S"]

#: seconds a rank waits in one of these collectives before the warning (a slow rank, one writing
#: a large checkpoint, is still waited for: the warning changes nothing else)
WARN_AFTER_S = 60.0


@contextlib.contextmanager
def collective(what: str, rank: int, world_size: int) -> Iterator[None]:
    """Around a blocking collective made outside the training step. If the block has not ended
    after :data:`WARN_AFTER_S` seconds, warn once (a ``RuntimeWarning`` from a timer thread)
    naming ``what`` and this ``rank``, and saying that every rank must make the call. Nothing
    happens with ``world_size`` 1. The collective itself goes on: it ends when the other ranks
    join, or fails at the process group's timeout."""
    if world_size <= 1:
        yield
        return
    after = WARN_AFTER_S

    def warn() -> None:
        warnings.warn(f"zeroinf: rank {rank} has waited {after:g} s in {what}, a collective: every rank must "
                      f"make this call (e.g. call model.state_dict() on all ranks and save on rank 0 only). "
                      f"If another rank is only slow this goes on when it arrives; otherwise it waits until the "
                      f"process group's timeout", RuntimeWarning, stacklevel=1)
    timer = threading.Timer(after, warn)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
