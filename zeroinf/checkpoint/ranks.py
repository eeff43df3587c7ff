"""Agreement between ranks around a save or a load: one tag for all, and a failure on any rank
raised on every rank (so none goes on alone, and none waits forever)."""
from __future__ import annotations

import errno
import logging
import os
import shutil
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from zeroinf.waits import collective

from .files import CheckpointError

_log = logging.getLogger("zeroinf")


def _barrier(engine, what: str) -> None:
    if engine.world_size > 1:
        with collective(what, engine.rank, engine.world_size):
            dist.barrier()


def _same_tag(engine, tag: Optional[str], what: str) -> Optional[str]:
    """The tag every rank uses for this save or load: rank 0's. Collective with more than one
    rank (every rank sends its tag). Ranks passing different tags would write one checkpoint split
    over several folders, none of them loadable, or load a mix of steps; DeepSpeed's
    ``checkpoint.tag_validation`` ("warn" by default) only logs that. Here "fail" raises on every
    rank, "warn" logs the ranks' tags and goes on with rank 0's, "ignore" takes rank 0's silently.

    Raises:
        ValueError: the tags differ and ``checkpoint.tag_validation`` is "fail" (nothing was
            written or loaded).
    """
    if engine.world_size == 1:
        return tag
    tags = [None] * engine.world_size
    with collective(what, engine.rank, engine.world_size):
        dist.all_gather_object(tags, tag)
    if all(t == tags[0] for t in tags):
        return tag
    mode = engine.config.checkpoint.tag_validation
    listing = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
    if mode == "fail":
        raise ValueError(f"{what}: the ranks passed different tags ({listing}) and checkpoint.tag_validation is "
                         f"\"Fail\"; nothing was {'saved' if what == 'save_checkpoint' else 'loaded'}")
    if mode == "warn" and engine.rank == 0:
        _log.warning("%s: the ranks passed different tags (%s); every rank uses rank 0's (checkpoint.tag_validation "
                     "\"Warn\")", what, listing)
    return tags[0]


def _on_every_rank(engine, flag: bool, what: str) -> bool:
    """Collective with more than one rank: whether ``flag`` is true on every rank."""
    if engine.world_size == 1:
        return flag
    t = torch.tensor([float(flag)], device=engine.params.device)
    with collective(what, engine.rank, engine.world_size):
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _agree(engine, problem: Optional[BaseException], others, what: str) -> None:
    """Collective (in place of a barrier): raise on every rank if any rank failed: ``problem``
    on the rank that had it, ``others(failed_ranks)`` on the rest. So no rank goes on (loads,
    renames a save into place) while another stopped, and none waits for it forever."""
    failed = problem is not None
    if engine.world_size > 1:
        flags = torch.zeros(engine.world_size, dtype=torch.float32, device=engine.params.device)
        flags[engine.rank] = float(failed)
        with collective(what, engine.rank, engine.world_size):
            dist.all_reduce(flags)
        bad = [r for r, f in enumerate(flags.tolist()) if f]
        if bad and not failed:
            raise others(bad)
    if problem is not None:
        raise problem


def _agree_or_drop(engine, problem: Optional[BaseException], work: str, final: str) -> None:
    """:func:`_agree` on a save's writes; when any rank failed, each removes the unfinished
    folder ``work`` first: left on a full disk, it would keep the space that the next save (under
    another tag, global_stepN) needs, so every retry would fail too. Not once the earlier save
    of the tag was moved aside (``final.old``): ``work`` is then the complete new save, and the
    renames failed between the two."""
    try:
        _agree(engine, problem, _write_failed, "save_checkpoint")
    except BaseException:
        if not os.path.isdir(final + ".old"):
            shutil.rmtree(work, ignore_errors=True)
        raise


def _write_failed(bad) -> OSError:
    return OSError(errno.EIO, f"rank(s) {bad} could not write their checkpoint files (their errors name them); "
                              "nothing of this save was put in place")


def _read_on_every_rank(engine, load_dir: str, tag: Optional[str], read: Callable[[Optional[str]], Any]) -> Any:
    """The first half of :func:`load` and :func:`load_weights` (collective): every rank takes
    rank 0's tag; when it is None and no rank finds a ``latest`` file, warn and return None
    (DeepSpeed's answer, which its auto-resume scripts test for: a first run has nothing to
    load); else ``read(tag)`` on every rank, and its result once every rank has read.

    Raises:
        CheckpointError: ``read`` failed on some rank (this rank's own error where it failed);
            nothing was loaded on any rank.
        ValueError: the ranks passed different tags (see :func:`_same_tag`).
    """
    engine.synchronize()
    tag = _same_tag(engine, None if tag is None else str(tag), "load_checkpoint")
    if tag is None and _on_every_rank(engine, not os.path.isfile(os.path.join(load_dir, "latest")), "load_checkpoint"):
        if engine.rank == 0:
            _log.warning("load_checkpoint(%r): no 'latest' file there, so nothing was loaded (returns None, None); "
                         "pass tag= to load a checkpoint by name", load_dir)
        return None
    problem, found = None, None
    try:
        found = read(tag)
    except Exception as exc:  # not only CheckpointError: every rank must reach the agreement
        problem = exc
    _agree(engine, problem, lambda bad: CheckpointError(
        f"rank(s) {bad} could not use their checkpoint files (their errors name them); nothing was loaded on any rank"),
        "load_checkpoint")
    return found
