"""Arguments of an I/O request checked and put in the form the engines take: a tensor as its
flat bytes, an open descriptor as a path the handle can open itself."""
from __future__ import annotations

import fcntl
import os
import stat

import torch

__all__ = ["byte_view", "writable_fd_path"]


def byte_view(buffer, name: str = "buffer") -> torch.Tensor:
    """``buffer``'s bytes as a flat ``torch.uint8`` view (same memory, so a read lands in it).

    Raises:
        TypeError: not a tensor.
        ValueError: not on the CPU, not strided, a lazy conjugate/negative view, or not
            contiguous (the message names ``name`` and the fix).
    """
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {buffer.device}")
    if buffer.layout != torch.strided:  # sparse: is_contiguous() says True, yet it has no flat bytes
        raise ValueError(f"{name} is a {buffer.layout} tensor, which has no flat bytes; pass a dense one (.to_dense())")
    if buffer.is_conj() or buffer.is_neg():  # a lazy view: its bytes are not its values
        raise ValueError(f"{name} is a lazily {'conjugated' if buffer.is_conj() else 'negated'} view; pass "
                         f"a plain tensor ({'.resolve_conj()' if buffer.is_conj() else '.resolve_neg()'} makes one, a copy)")
    if not buffer.is_contiguous():
        raise ValueError(f"{name} must be contiguous (a .contiguous() copy would not receive the data)")
    return buffer.reshape(-1).view(torch.uint8)


def writable_fd_path(fd) -> str:
    """``/proc/self/fd/<fd>``: a path that opens the regular file ``fd`` refers to, so a write
    given a descriptor runs through the handle's own (O_DIRECT and buffered) descriptors.

    Raises:
        ValueError: ``fd`` is not an open descriptor of a regular file opened for writing.
    """
    if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
        raise ValueError(f"fd: expected an open file descriptor (an integer >= 0), got {fd!r}")
    try:
        st = os.fstat(fd)
        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    except OSError as exc:
        raise ValueError(f"fd {fd}: not an open file descriptor ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"fd {fd}: not a regular file")
    if mode not in (os.O_WRONLY, os.O_RDWR):
        raise ValueError(f"fd {fd}: opened read-only; open it with O_WRONLY or O_RDWR to write through it")
    return f"/proc/self/fd/{fd}"
