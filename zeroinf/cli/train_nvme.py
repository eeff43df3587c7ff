"""``zeroinf train``'s private swap folders (one per rank under the working directory when no
``--nvme-path`` is given), and where rank 0's header says the swap files go."""
from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

__all__ = ["PRIVATE_PREFIX", "make_private_dir", "remove_stale_private_dirs", "swap_where"]

# [Note: private swap folders] Without --nvme-path each rank swaps into a folder of its own,
# .zeroinf-nvme-r{rank}-XXXXXXXX under the working directory, removed when the run ends. A run
# killed outright (a second Ctrl-C or SIGTERM gets the default action, SIGKILL, OOM) cannot
# remove it, and its swap files can be gigabytes in a hidden folder. So the folder is flock()ed
# for the run's lifetime (the kernel drops the lock when the process dies however it dies), and
# a later run in the same directory, of any rank, removes such folders that nobody holds. Only
# folders this scheme made are candidates: the name as mkdtemp makes it, owned by this user, and
# holding the OWNER file (a regular file naming this host) written under the lock. So an older
# version's folders (never locked, possibly a --keep run's or a live run's), another
# user's, another host's (a shared file system whose flock may be local to each host) and
# names a person chose are left alone. A folder is made under another prefix and renamed once locked and
# marked, so no scan sees it unlocked; a --keep run's folder carries a KEPT file and stays; where
# flock is not supported nothing is removed. A made-but-unmarked folder left by a run killed between
# those steps is empty; it is removed once an hour old (no run is that long between two calls).
PRIVATE_PREFIX = ".zeroinf-nvme-r"
_NEW_PREFIX = ".zeroinf-new-r"
_OWNER = "OWNER"
_KEPT = "KEPT"
_NEW_STALE_S = 3600  # an empty .zeroinf-new-r folder this old was left by a run killed while making it
_PRIVATE_NAME = re.compile(r"\.zeroinf-(nvme|new)-r[0-9]+-[a-z0-9_]{8}")  # fullmatch: no trailing newline


def make_private_dir(parent: Path, rank: int, keep: bool = False) -> Tuple[Path, int]:
    """Create rank ``rank``'s private swap folder under ``parent``, lock and mark it ([Note:
    private swap folders]). Returns ``(folder, fd)``; the lock holds until ``fd`` is closed.

    Raises:
        OSError: the folder cannot be created, opened or marked in ``parent``.
    """
    import fcntl
    d = Path(tempfile.mkdtemp(prefix=f"{_NEW_PREFIX}{rank}-", dir=parent))
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # no flock on this file system: remove_stale_private_dirs cannot take it either
        if keep:
            (d / _KEPT).write_text("written by zeroinf train --keep: a later run leaves this folder alone\n")
        (d / _OWNER).write_text(f"{socket.gethostname()}\nzeroinf train, pid {os.getpid()}: a later run on this host "
                                "removes this folder once no process holds its lock\n")
        final = parent / (PRIVATE_PREFIX + f"{rank}-" + d.name.rsplit("-", 1)[1])
        os.rename(d, final)
    except BaseException:
        os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
        raise
    return final, fd


def remove_stale_private_dirs(parent: Path) -> List[Tuple[Path, int]]:
    """Remove the private swap folders under ``parent`` (of any rank) that this scheme made, that
    belong to this user, and that no live run holds or a --keep run left ([Note: private swap
    folders]). Returns ``(folder, bytes of its files)`` for each one removed; a folder that
    cannot be inspected, opened or locked is left as it is. Never raises for a folder."""
    import fcntl
    removed = []
    try:
        entries = sorted(parent.iterdir())
    except OSError:
        return removed
    for d in entries:
        if not _PRIVATE_NAME.fullmatch(d.name):
            continue
        try:
            st = d.lstat()
            if (d.name.startswith(_NEW_PREFIX) and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
                    and time.time() - st.st_mtime > _NEW_STALE_S and not any(d.iterdir())):
                # killed between mkdtemp and writing OWNER: empty, and old enough that no run is
                # still between those two calls; rmdir takes only an empty folder
                os.rmdir(d)
                removed.append((d, 0))
                continue
            if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or os.path.lexists(d / _KEPT)
                    or not stat.S_ISREG((d / _OWNER).lstat().st_mode)
                    or (d / _OWNER).read_text().split("\n", 1)[0] != socket.gethostname()):
                continue  # a link as OWNER; another host's run over a shared file system
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # another user's 0700 folder (Path.exists raised EACCES)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by a live run (EWOULDBLOCK), or no flock here
            os.close(fd)
            continue
        try:
            nbytes = sum(f.lstat().st_size for f in d.rglob("*") if f.is_file() and not f.is_symlink())
            shutil.rmtree(d)
            removed.append((d, nbytes))
        except OSError:
            pass  # removed by hand meanwhile, or a file we may not delete: not ours to force
        finally:
            os.close(fd)
    return removed



def swap_where(zcfg, world_size: int = 1, private: bool = False) -> str:
    """``"; swap files in DIR[, DIR]"`` for rank 0's header, or ``""`` without NVMe: a config's own
    nvme_path (the presets' /local_nvme) is created if missing, so say where the files go.
    With ``private`` folders over several ranks, rank 0's is named and the others' are said to lie
    beside it."""
    z = zcfg.zero_optimization
    dirs = dict.fromkeys(b.nvme_path for b in (z.offload_param, z.offload_optimizer) if b.device == "nvme")
    if not dirs:
        return ""
    others = "rank 1 has its own" if world_size == 2 else f"ranks 1-{world_size - 1} have their own"
    more = f" (rank 0's; {others} {PRIVATE_PREFIX}N- beside it)" if private and world_size > 1 else ""
    return f"; swap files in {', '.join(dirs)}{more}"
