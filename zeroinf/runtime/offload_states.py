"""``engine.offload_states()`` / ``engine.reload_states()``: every tensor of an engine's state
out of memory, into one file, and back bit for bit (DeepSpeed's API for RLHF phases, where a
second model needs the memory between training steps).

What moves: every storage reachable from the engine (the model's parameters, buffers and
gradients; the fp32 master weights and Adam moments held in memory; stages 0-2's flat parameter
and gradient buffers; stage 3's host-resident partitions and gradient shards). Each storage's
bytes are written to the file and the storage is resized to 0 bytes, so every tensor that views
it (a parameter viewing a flat buffer, a master aliasing a parameter) keeps its identity and
sees its bytes again after the reload. What stays: state already on NVMe (swap files), and the
page-locked swap/staging pools (they hold no state between steps; their storages are not
resizable). The file goes to ``path``, by default the config's ``offload_optimizer`` or
``offload_param`` ``nvme_path``, else the system temp folder, and is removed by the reload.
"""
from __future__ import annotations

import ctypes
import enum
import os
import tempfile
import types
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from torch import nn


class Residency(enum.Enum):
    """Where an engine's state is: in memory (``RESIDENT``) or in its offload file (``OFFLOADED``)."""
    RESIDENT = "resident"
    OFFLOADED = "offloaded"


@dataclass
class _Moved:
    """One storage written to the file at ``offset``: ``nbytes`` bytes on ``device``."""
    storage: Any  # torch.UntypedStorage, resized to 0 bytes while offloaded
    nbytes: int
    offset: int


@dataclass
class OffloadedStates:
    """The record of one :func:`offload`: the file and every storage moved into it."""
    path: str
    moved: List[_Moved] = field(default_factory=list)
    hooks: List[Any] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes moved out of memory (the file's size)."""
        return sum(m.nbytes for m in self.moved)


def _storages(root: Any) -> List[Any]:
    """Every resizable, non-empty storage reachable from ``root`` through zeroinf objects,
    containers, modules (parameters, buffers, ``.grad``) and tensors, each once, in a fixed
    order. Storages of a :class:`zeroinf.io.PinnedBufferPool` are left out (their addresses key
    the pool's bookkeeping)."""
    from zeroinf.io import PinnedBufferPool
    seen, found, pooled, order = set(), {}, set(), []
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, types.ModuleType,
                                                              type, torch.dtype, torch.device)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.is_meta or obj.layout != torch.strided:
                continue
            s = obj.untyped_storage()
            key = s._cdata
            if key not in found and s.nbytes() > 0:
                found[key] = s
                order.append(key)
            if obj.grad is not None:
                stack.append(obj.grad)
        elif isinstance(obj, PinnedBufferPool):
            pooled.update(b.untyped_storage()._cdata for b in obj.buffers())
        elif isinstance(obj, nn.Module):
            stack.extend(obj.parameters())
            stack.extend(obj.buffers())
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("zeroinf.") or isinstance(obj, torch.optim.Optimizer):
            if hasattr(obj, "__dict__"):
                stack.append(vars(obj))
            for klass in type(obj).__mro__:
                for name in getattr(klass, "__slots__", ()):
                    stack.append(getattr(obj, name, None))
    return [found[k] for k in order if k not in pooled and found[k].resizable()]


def _bytes_view(storage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _host_buffer(t: torch.Tensor) -> memoryview:
    """A writable buffer over CPU tensor ``t``'s bytes, without copying. Not ``t.numpy()``: that
    marks the storage not resizable for good."""
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


def _refuse(*_args, **_kwargs):
    raise RuntimeError("zeroinf: the engine's states are offloaded (engine.offload_states()); call "
                       "engine.reload_states() before running or saving the model")


def offload(engine, path: Optional[str] = None) -> OffloadedStates:
    """Write every storage of ``engine``'s state to a new file under ``path`` (a folder) and free it.

    Returns:
        The :class:`OffloadedStates` record that :func:`reload` takes.

    Raises:
        OSError: the file cannot be written (disk full, no such folder); every storage
            written so far is restored first, so the engine is as it was.
    """
    folder = path or _default_folder(engine)
    fd, file = tempfile.mkstemp(prefix="zeroinf-offloaded-states-", suffix=".bin", dir=folder)
    record = OffloadedStates(file)
    try:
        with os.fdopen(fd, "wb") as f:
            for s in _storages(engine):
                n = s.nbytes()
                record.moved.append(_Moved(s, n, f.tell()))
                f.write(_host_buffer(_bytes_view(s).cpu()))
    except BaseException:
        os.unlink(file)
        raise
    for m in record.moved:  # only once the whole file is written: a failure above changed nothing
        m.storage.resize_(0)
    record.hooks = [engine.module.register_forward_pre_hook(_refuse, prepend=True),
                    engine.module.register_state_dict_pre_hook(_refuse)]
    return record


def reload(record: OffloadedStates) -> None:
    """Give every storage of ``record`` its bytes back from the file, then remove the file.

    Raises:
        OSError: the file is missing or shorter than what was written (named); storages
            already read keep their bytes, the others stay empty, and the file is kept.
    """
    with open(record.path, "rb") as f:
        for m in record.moved:
            m.storage.resize_(m.nbytes)
            dst = _bytes_view(m.storage)
            host = dst if dst.device.type == "cpu" else torch.empty(m.nbytes, dtype=torch.uint8)
            f.seek(m.offset)
            got = f.readinto(_host_buffer(host))
            if got != m.nbytes:
                raise OSError(f"{record.path}: {got} of {m.nbytes} bytes at offset {m.offset} could be read back")
            if host is not dst:
                dst.copy_(host)
    for h in record.hooks:
        h.remove()
    os.unlink(record.path)


def _default_folder(engine) -> str:
    """The optimizer's, else the parameters', ``nvme_path``, else the system temp folder."""
    zc = engine.config.zero_optimization
    for off in (zc.offload_optimizer, zc.offload_param):
        if getattr(off, "device", None) == "nvme" and getattr(off, "nvme_path", None):
            return off.nvme_path
    return tempfile.gettempdir()
