"""The files of a checkpoint: their names, atomic writes, checked reads and the ``latest`` pointer."""
from __future__ import annotations

import errno
import os
import re
import shutil
import traceback
from typing import Any, Dict, Optional, Tuple

import torch

from zeroinf.io.atomic import write_text_then_rename, write_then_rename

#: the layout version written into ``model_states.pt``; a load refuses any other
_FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not match the engine loading it (names the file)."""


def save_atomically(obj: Any, path: str) -> None:
    """``torch.save`` (safetensors' ``save_file`` for a ``.safetensors`` path, of a dict of
    contiguous tensors) to a temporary file renamed onto ``path``; on failure the temporary file
    is removed and what was at ``path`` is left as it was. Raises OSError naming ``path`` when the
    write fails: torch's writer reports a full disk or a file-size limit as a RuntimeError about
    stream positions, without the path, and safetensors as a SafetensorError, which is no OSError;
    the error number is the one the writer names (``os error 27``), else ENOSPC
    for a full file system, EFBIG at the file-size limit, EIO otherwise."""
    written, free = 0, None  # how far a failed write got, and the room left then: for the error number

    def write(tmp: str) -> None:
        nonlocal written, free
        try:
            if path.endswith(".safetensors"):
                from safetensors.torch import save_file
                save_file(obj, tmp)
            else:
                torch.save(obj, tmp)
        except BaseException as exc:
            written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
            free = shutil.disk_usage(os.path.dirname(path) or ".").free  # before the file below is closed
            # the writer's frames hold its open file: kept alive by the error (and the OSError
            # chained to it) until a garbage collection, the unlinked file would keep its space
            # and the full disk would stay full; their locals are dropped now
            seen, chain = set(), [exc]
            while chain:  # the error and those it was raised during (torch's writer closing)
                e = chain.pop()
                if e is not None and id(e) not in seen:
                    seen.add(id(e))
                    traceback.clear_frames(e.__traceback__)
                    chain += [e.__context__, e.__cause__]
            raise

    try:
        write_then_rename(path, write)
    except Exception as exc:
        if not isinstance(exc, OSError):  # the writer's own error types
            if free is None:
                free = shutil.disk_usage(os.path.dirname(path) or ".").free
            raise OSError(_write_errno(str(exc), free, written), f"{path}: writing the file failed ({free} bytes free "
                          f"on its file system; {type(exc).__name__}: {str(exc).strip()})") from exc
        raise


def _write_errno(message: str, free: int, written: int) -> int:
    """The error number behind a writer's failure message (see :func:`save_atomically`)."""
    found = re.search(r"os error (\d+)", message)
    if found:
        return int(found.group(1))
    if free == 0:
        return errno.ENOSPC
    import resource  # POSIX only: imported where it is needed
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and written >= limit:
        return errno.EFBIG
    return errno.EIO


def _read(path: str, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU (``mmap``: tensors mapped, read on
    use). Raises CheckpointError naming ``path`` when the file cannot be read or unpickled
    (truncated, not a torch file)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable: truncated, corrupt or not a torch file ({type(exc).__name__}: "
                              f"{str(exc).strip()[:300]}); nothing was loaded") from exc


def _optim_file(ckpt: str, rank: int, key: str) -> str:
    return os.path.join(ckpt, f"optim_rank{rank}_{key.replace('/', '_')}.pt")


def _replace_dir(work: str, final: str) -> None:
    """Move the finished folder ``work`` onto ``final``: an older ``final`` is renamed aside
    first and removed after, so no reader ever sees a mix of two saves."""
    old = final + ".old"
    if os.path.isdir(old):
        shutil.rmtree(old)
    if os.path.isdir(final):
        os.rename(final, old)
    os.rename(work, final)
    shutil.rmtree(old, ignore_errors=True)


def write_latest(save_dir: str, tag: str) -> None:
    """Point ``save_dir/latest`` at ``tag`` (DeepSpeed's file: the tag as text), through a
    rename, so a reader sees the old tag or the new one.

    Raises:
        OSError: naming ``latest`` and saying that the checkpoint itself is complete.
    """
    latest = os.path.join(save_dir, "latest")
    try:
        write_text_then_rename(latest, tag)
    except OSError as exc:
        raise OSError(exc.errno, f"{latest}: cannot record the tag {tag!r} ({exc.strerror or exc}); the "
                                 f"checkpoint itself is complete in {os.path.join(save_dir, tag)}") from exc


def _load_meta(load_dir: str, tag: Optional[str]) -> Tuple[str, Dict[str, Any]]:
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            raise CheckpointError(f"{latest}: no 'latest' file; pass the tag explicitly")
        with open(latest) as f:
            tag = f.read().strip()
    ckpt = os.path.join(load_dir, tag)
    path = os.path.join(ckpt, "model_states.pt")
    if not os.path.isfile(path):
        hint = ""
        if os.path.isfile(os.path.join(ckpt + ".old", "model_states.pt")):
            hint = (f"; {ckpt}.old holds the previous complete save of this tag (a re-save was interrupted "
                    f"between its renames): rename it to {ckpt} to load it")
        raise CheckpointError(f"{path}: missing (no checkpoint with tag {tag!r}, or an incomplete save){hint}")
    meta = _read(path)
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path}: checkpoint format {fmt!r}, this zeroinf reads {_FORMAT}")
    return ckpt, meta
