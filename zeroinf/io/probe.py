"""Can a directory hold swap files? One probe with a reason a person can act on.

``os.access`` answers from permission bits, which say nothing for root, a read-only mount or a
kernel file system; so the probe creates and writes a real file. When that fails the errno alone
often misleads: creating a file under ``/proc/sys`` fails with ENOENT ("No such file or
directory") although the directory exists. :func:`dir_problem` names the file system type in
such cases.
"""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Optional

__all__ = ["dir_problem", "fs_type"]

#: kernel/virtual file systems: they exist as directories but never hold regular files of ours
_VIRTUAL_FS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "securityfs", "devpts", "configfs",
                         "tracefs", "pstore", "bpf", "efivarfs", "fusectl", "mqueue", "binfmt_misc", "autofs",
                         "hugetlbfs", "nsfs"})


def fs_type(path: str) -> Optional[str]:
    """The file system type (``"ext4"``, ``"proc"``, ...) of the mount holding ``path``, from
    ``/proc/self/mountinfo``; None when that cannot be read."""
    real = os.path.realpath(path)
    best, kind = -1, None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mnt = fields[4].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) > best:
                    best, kind = len(mnt), right.split()[0]
    except OSError:
        return None
    return kind


def dir_problem(path: str, create: bool = False) -> Optional[str]:
    """Why swap files cannot be created in directory ``path``, in words (for an error message
    that starts with the path or its config key); None when a probe file could be created,
    written and removed there.

    With ``create``, a missing ``path`` is made first, with its missing parents (as DeepSpeed's
    swappers make their ``nvme_path`` folders); when that fails, the reason names the nearest
    existing parent and what is wrong with it.
    """
    if create and not os.path.lexists(path):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            parent = next((str(p) for p in Path(path).absolute().parents if p.exists()), "/")
            why = dir_problem(parent)
            return f"cannot be created: {parent} {why}" if why else \
                f"cannot be created: {exc.strerror or exc}"
    if not os.path.exists(path):
        if os.path.islink(path):  # the link exists; its target does not
            return f"is a symbolic link to {os.readlink(path)}, which does not exist"
        return "does not exist"
    if not os.path.isdir(path):
        return "is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".zeroinf-probe-") as f:
            f.write(b"\0")
            f.flush()
    except OSError as exc:
        kind = fs_type(path)
        if kind in _VIRTUAL_FS:
            return f"is on a '{kind}' file system (kernel files, not storage): swap files cannot be created there"
        if exc.errno == errno.EROFS:
            return "is on a read-only file system"
        if exc.errno in (errno.EACCES, errno.EPERM):
            return f"is not writable by this user (uid {os.geteuid()}): {exc.strerror}"
        if exc.errno == errno.ENOSPC:
            return "is on a full file system"
        return f"is not writable: creating a file there failed with {errno.errorcode.get(exc.errno, exc.errno)} " \
               f"({exc.strerror or exc}) on a '{kind or 'unknown'}' file system"
    return None
