"""``zeroinf train``'s periodic checkpoints: when to save, how a save is made durable, which
checkpoint a ``--resume`` takes, and the run's state file ``run.json``.

Layout of ``OUT/checkpoint/`` (the engine's layout, DeepSpeed's)::

    step{N}/      one engine checkpoint after optimizer step N (see :mod:`zeroinf.checkpoint`)
    latest        the tag of the newest complete checkpoint, as text

A save is complete once ``latest`` names it, and ``latest`` is replaced only after the new
checkpoint's files and folders are fsync()ed: the engine writes ``step{N}.saving`` and renames it
onto ``step{N}``; every file under it, the folder and ``checkpoint/`` are then synced; ``latest`` is
written to a temporary file, synced, renamed over the old one, and ``checkpoint/`` synced again;
only then are checkpoints beyond the newest ``keep`` removed. A process killed at any moment
(SIGKILL, a power cut) therefore leaves ``latest`` naming a whole checkpoint, or no ``latest``
before the first save. Anything else under ``checkpoint/`` that ``latest`` does not cover (a
``.saving`` folder, a ``step{N}`` newer than ``latest``) is what a killed save left, and
:meth:`CheckpointDir.clear_partial` removes it.
"""
from __future__ import annotations

import argparse
import datetime
import enum
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from zeroinf.io.atomic import write_then_rename

__all__ = ["SaveEvery", "SaveClock", "CheckpointDir", "RunState", "parse_save_every", "write_run_json",
           "read_run_state", "lock_out", "AUTO_SAVE_SHARE"]

#: ``--save-every auto`` keeps the wall time spent saving at or below this share of the run
AUTO_SAVE_SHARE = 0.05
_STEP_TAG = re.compile(r"step([0-9]+)")
_ENTRY = re.compile(r"step[0-9]+(\.saving|\.old)?|latest\.tmp[0-9]+")  # what saves of this layout create


class SaveKind(enum.Enum):
    """How ``--save-every`` decides when a periodic checkpoint is due."""

    OFF = "off"          # no periodic checkpoint (Ctrl-C still saves)
    STEPS = "steps"      # after every ``value`` optimizer steps
    SECONDS = "seconds"  # once ``value`` seconds have passed since the last save (or the run's start)
    AUTO = "auto"        # once the time since the last save is 1/AUTO_SAVE_SHARE - 1 times that save's


@dataclass(frozen=True)
class SaveEvery:
    """A parsed ``--save-every``: ``kind`` and its ``value`` (optimizer steps for STEPS, seconds
    for SECONDS; unused for OFF and AUTO)."""

    kind: SaveKind
    value: float = 0.0


def parse_save_every(text: str) -> SaveEvery:
    """``--save-every``: ``N`` (optimizer steps), ``Nm`` / ``Ns`` (minutes / seconds, N > 0, a
    decimal allowed), ``auto``, or ``0`` / ``off``.

    Raises:
        argparse.ArgumentTypeError: any other text (argparse names the option).
    """
    t = str(text).strip().lower()
    if t == "auto":
        return SaveEvery(SaveKind.AUTO)
    if t in ("0", "off"):
        return SaveEvery(SaveKind.OFF)
    if t.isdigit():
        return SaveEvery(SaveKind.STEPS, int(t))
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?)([ms])", t)
    if m and float(m.group(1)) > 0:
        return SaveEvery(SaveKind.SECONDS, float(m.group(1)) * (60 if m.group(2) == "m" else 1))
    raise argparse.ArgumentTypeError(f"{text!r}: give a number of steps (10), minutes (10m), seconds (90s), "
                                     "auto, or 0 for none")


def save_every_arg(text: str) -> str:
    """argparse ``type`` of ``--save-every``: the text, checked (run.json stores it as given)."""
    parse_save_every(text)
    return text


class SaveClock:
    """Whether a periodic checkpoint is due after a step. Times are ``time.monotonic()`` seconds;
    ``auto`` saves after the first step (no save cost known yet), then once the time since the
    end of the last save reaches ``(1 / AUTO_SAVE_SHARE - 1)`` times that save's duration."""

    def __init__(self, every: SaveEvery, first_step: int, now: Optional[float] = None):
        self.every = every
        self.last_step = first_step - 1
        self.last_end = time.monotonic() if now is None else now
        self.last_took: Optional[float] = None

    def due(self, step: int, now: Optional[float] = None) -> bool:
        """Whether a checkpoint is due after optimizer step ``step`` (1-based), at monotonic time
        ``now`` (seconds; default the clock's)."""
        now = time.monotonic() if now is None else now
        k = self.every.kind
        if k is SaveKind.OFF:
            return False
        if k is SaveKind.STEPS:
            return step - self.last_step >= self.every.value
        if k is SaveKind.SECONDS:
            return now - self.last_end >= self.every.value
        return self.last_took is None or now - self.last_end >= self.last_took * (1 / AUTO_SAVE_SHARE - 1)

    def saved(self, step: int, took_s: float, now: Optional[float] = None) -> None:
        """Record a save after step ``step`` that took ``took_s`` seconds and ended at monotonic
        time ``now`` (default the clock's)."""
        self.last_step, self.last_took = step, took_s
        self.last_end = time.monotonic() if now is None else now


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, (os.O_RDONLY | os.O_DIRECTORY) if directory else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str) -> None:
    """fsync() every regular file under ``folder``, every folder in it, ``folder`` itself and its
    parent (which holds its name). Raises OSError naming the path that failed."""
    for here, _dirs, files in os.walk(folder):
        for name in files:
            p = os.path.join(here, name)
            if os.path.isfile(p) and not os.path.islink(p):
                _fsync_path(p)
        _fsync_path(here, directory=True)
    _fsync_path(os.path.dirname(os.path.abspath(folder)), directory=True)


def write_durably(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a crash at any moment leaves the old content or
    the new, on disk: a temporary file beside it, fsync()ed, renamed over ``path``, and the
    folder fsync()ed. Raises OSError (a full disk: ENOSPC)."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    write_then_rename(path, write)
    _fsync_path(str(path.parent), directory=True)


class CheckpointDir:
    """``OUT/checkpoint``: the periodic checkpoints of one run (see the module docstring).

    ``barrier`` is the ranks' barrier (a no-op with one rank); every rank calls :meth:`save`.
    """

    def __init__(self, root: Path, rank: int = 0, barrier: Callable[[], None] = lambda: None):
        self.root, self.rank, self.barrier = Path(root), rank, barrier

    @staticmethod
    def tag(step: int) -> str:
        """The checkpoint tag of optimizer step ``step``: ``step<N>``."""
        return f"step{step}"

    def newest_complete(self) -> Optional[Tuple[str, int]]:
        """``(tag, step)`` of the checkpoint ``latest`` names, or None without a ``latest``.

        Raises:
            ValueError: ``latest`` names no ``step{N}`` folder of this layout (the message names it).
        """
        latest = self.root / "latest"
        if not latest.is_file():
            return None
        tag = latest.read_text().strip()
        m = _STEP_TAG.fullmatch(tag)
        if m is None or not (self.root / tag).is_dir():
            raise ValueError(f"{latest}: names {tag!r}, which is no step<N> folder there; the checkpoints were "
                             "moved or edited")
        return tag, int(m.group(1))

    def _entries(self) -> List[Path]:
        try:
            return [p for p in self.root.iterdir() if _ENTRY.fullmatch(p.name)]
        except FileNotFoundError:
            return []

    def clear_partial(self, newest: Optional[int]) -> List[Path]:
        """Remove what saves left that the checkpoint of step ``newest`` (None: no complete one)
        does not cover: ``.saving`` / ``.old`` folders, temporary ``latest`` files, and ``step{N}``
        folders with N above ``newest``. Returns what was removed."""
        gone = []
        for p in self._entries():
            m = _STEP_TAG.fullmatch(p.name)
            if m is not None and newest is not None and int(m.group(1)) <= newest:
                continue
            _remove(p)
            gone.append(p)
        return gone

    def save(self, engine, step: int, keep: int) -> float:
        """Checkpoint ``engine`` after optimizer step ``step`` as ``step{step}`` (collective), make it
        durable, point ``latest`` at it, then keep the newest ``keep`` (>= 1) checkpoints up to it.
        Returns the seconds it took.

        Raises:
            OSError: a file cannot be written or synced (the message names it); ``latest`` then
                still names the previous checkpoint.
        """
        t0 = time.perf_counter()
        tag = self.tag(step)
        self.root.mkdir(parents=True, exist_ok=True)
        engine.save_checkpoint(str(self.root), tag, save_latest=False)
        fsync_tree(str(self.root / tag))
        self.barrier()  # every rank's files are on disk before latest names them
        if self.rank == 0:
            write_durably(self.root / "latest", tag)
        self.barrier()  # no rank removes the checkpoint latest named until it names the new one
        entries = self._entries()
        steps = sorted((int(m.group(1)) for m in map(_STEP_TAG.fullmatch, (p.name for p in entries))
                        if m is not None and int(m.group(1)) <= step), reverse=True)
        kept = {self.tag(s) for s in steps[:keep]}
        for p in entries:
            if p.name not in kept:
                _remove(p)
        return time.perf_counter() - t0

    def drop_all(self) -> None:
        """Remove ``latest`` first (so no reader takes a folder being removed), then every
        checkpoint of this layout: the run completed, and they no longer say where it stands."""
        (self.root / "latest").unlink(missing_ok=True)
        for p in self._entries():
            _remove(p)
        try:
            self.root.rmdir()  # only when empty: anything else a person put there stays
        except OSError:
            pass


def _remove(p: Path) -> None:
    """Remove a file or folder that saves made; another rank removing it at once is no error."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


class RunState(enum.Enum):
    """``run.json``'s ``state``: where the run in ``--out`` stands."""
    RUNNING = "running"          # started; a process killed outright leaves this
    INTERRUPTED = "interrupted"  # stopped by Ctrl-C / SIGTERM after a checkpoint
    COMPLETED = "completed"      # ran its --steps; not resumable


def write_run_json(out: Path, args: dict, state: RunState, completed_steps: int) -> None:
    """Write ``out/run.json`` (the run's arguments, for ``--resume``) durably.

    Raises:
        OSError: the write failed (the old ``run.json``, if any, is left as it was).
    """
    run = {"args": args, "state": state.value, "completed_steps": completed_steps,
           "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    write_durably(out / "run.json", json.dumps(run, indent=1))


def read_run_state(saved: dict) -> RunState:
    """The state of a loaded ``run.json``; files written before ``state`` existed carry
    ``interrupted`` (true or false) instead, and a file with neither counts as running (its
    checkpoint, if any, tells where it stands).

    Raises:
        ValueError: ``state`` is no :class:`RunState` value.
    """
    if "state" in saved:
        return RunState(saved["state"])
    if "interrupted" in saved:
        return RunState.INTERRUPTED if saved["interrupted"] else RunState.COMPLETED
    return RunState.RUNNING


def lock_out(out: Path) -> int:
    """flock() the folder ``out`` for the run's lifetime, so that a second run (a ``--resume``
    of a run still going) cannot clear or overwrite its checkpoints; the kernel drops the lock
    when the process dies, however it dies. Returns the descriptor to close at the end (where
    the file system has no flock, unlocked).

    Raises:
        BlockingIOError: a live process holds ``out``'s lock.
        OSError: ``out`` cannot be opened.
    """
    import fcntl
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError:
        pass  # no flock on this file system
    return fd
