"""Whole-file writes through a temporary file and a rename.

Every file the project writes whole (checkpoint shards and their ``latest`` tag, ``zeroinf
train``'s summaries, a stage-3 trace, ``zeroinf plan``'s config) goes through
:func:`write_then_rename`, so a failed write (a full disk, a file-size limit, Ctrl-C) leaves the
old file or none under the final name, never a truncated one.
"""
from __future__ import annotations

import os
import stat
from typing import Callable


def write_then_rename(path: "str | os.PathLike", write: Callable[[str], None]) -> None:
    """Call ``write(tmp)`` to write a temporary file beside ``path`` (``path.tmp<pid>``: ranks and
    processes writing the same name do not share it; the name cut to fit the file system's name
    limit), then rename it onto ``path``
    (``os.replace``, atomic within a file system). A replaced file's permission bits are kept
    (a rename would give the new file the umask's). On any failure, Ctrl-C included, the
    temporary file is removed and what was at ``path`` is left as it was.

    Args:
        path: the final file name (its folder must exist).
        write: writes the whole content to the file name it is given.

    Raises:
        whatever ``write`` or the rename raises (``OSError`` for a full disk), unchanged: callers
        add the name their user knows the file by.
    """
    path = os.fspath(path)
    folder, name = os.path.split(path)
    suffix = f".tmp{os.getpid()}"
    try:
        limit = os.pathconf(folder or ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    raw = name.encode()
    if len(raw) + len(suffix) > limit:  # a legal long name that the suffix makes too long
        name = raw[:limit - len(suffix)].decode(errors="ignore")
    tmp = os.path.join(folder, name + suffix)
    try:
        write(tmp)
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            mode = None
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_text_then_rename(path: "str | os.PathLike", text: str) -> None:
    """:func:`write_then_rename` of ``text`` (UTF-8). Raises OSError (a full disk: ENOSPC)."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    write_then_rename(path, write)
