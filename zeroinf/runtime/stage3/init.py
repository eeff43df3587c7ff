"""``zeroinf.Init``: partition parameters as modules are built, so a model larger than CPU
memory can be constructed.

Inside ``with zeroinf.Init(config=...)``, when a module's constructor returns, each parameter it
registered itself is moved out of memory — to a swap file under ``offload_param.nvme_path`` (or
kept in host memory for the other tiers) — and replaced by an empty placeholder. Only the
outermost constructor of an object does this, so a subclass that re-initialises weights after
``super().__init__()`` is seen. Each parameter's values were set by its module's own
initialisation (``reset_parameters``), with the same random stream as without ``Init``.

The stage-3 manager (``zeroinf.initialize`` with stage 3) then takes the values one flat group at
a time into the partitions, so at no point does the whole model sit in memory.

Changes made after a constructor returned (a Hugging Face ``post_init``) still apply: see
[Note: late initialisation]. After the ``with`` block a moved-out parameter is an empty
placeholder until ``zeroinf.initialize`` takes it (``state_dict()`` gives its held values:
[Note: state_dict before initialize]); compute on it raises ([Note: held placeholders refuse
compute]; so does ``p.data``, its placeholder: [Note: released parameters]). Read or change weights then
inside ``zeroinf.gathered_parameters(..., modifier_rank=0)`` or load them with
``load_safetensors``.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shutil
import tempfile
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zeroinf import progress

# init_shapes, init_shapes_of, init_dtype, take_init_values and check_placeholders are answered by
# the held registry and exported here too
from .held import (HELD, LOCK, Held, allow_copies, check_placeholders, held_forward_pre_hook, held_load_pre_hook,
                   held_state_dict_hook, init_dtype, init_shapes, init_shapes_of, pop_held, refuse_copies, rounded,
                   take_init_values)
from .released import attribute_of, mark_gathered, mark_released

__all__ = ["Init", "init_shapes", "init_shapes_of", "init_dtype", "take_init_values", "held_values",
           "check_placeholders", "swap_bytes_freed_by"]


def swap_bytes_freed_by(params) -> Dict[str, int]:
    """Bytes of ``Init`` swap files that taking all of ``params`` frees, by swap folder: an
    ``Init`` removes its folder once the last parameter it holds is taken, so only blocks whose
    every held parameter is among ``params`` count. For ``initialize``'s disk check: those files
    are gone before the optimizer's are made (counted as not free, a disk with room would be
    refused after ``Init``)."""
    params = list(params)
    with LOCK:
        mine: Dict[Init, int] = {}
        for p in params:
            held = HELD.get(p)
            if held is not None and held.host is None:
                mine[held.owner] = mine.get(held.owner, 0) + 1
    return {owner._dir: owner.held_bytes_nvme for owner, n in mine.items()
            if owner._dir is not None and Init._active is not owner and n == owner._outstanding}


@contextlib.contextmanager
def held_values(params: Sequence[nn.Parameter], modifier_rank: Optional[int]) -> Iterator[None]:
    """``zeroinf.gathered_parameters`` on parameters ``Init`` still holds (after the ``with``
    block, before ``zeroinf.initialize``): each one's ``.data`` is its full values for the
    block (in the placeholder's dtype and device: a ``model.half()`` made since applies), and
    the placeholder again afterwards. With ``modifier_rank`` not None a changed value is
    broadcast from that rank (torch.distributed's default group, when initialized with more
    than one rank; collective then) and held in place of the old one, so ``initialize`` takes
    it; unchanged values keep the held copy exactly; a parameter given data of another shape
    (transformers' ``resize_token_embeddings`` does that) keeps it and leaves ``Init``'s care,
    as a plain parameter. ``None``: changes are discarded.

    Parameters ``Init`` does not hold are skipped. Inside an active ``Init`` block the held
    parameters come back on their own ([Note: late initialisation]); nothing is done here.
    """
    params = list({id(p): p for p in params}.values())  # a tied pair listed twice
    with LOCK:
        todo = [(p, HELD[p]) for p in params if p in HELD and Init._active is not HELD[p].owner]
    entered = []  # [param, held, placeholder, values as given]
    try:
        for p, held in todo:
            ph = p.data
            given = held.owner._peek(held).to(device=ph.device, dtype=ph.dtype)
            p.data = given.clone()
            mark_gathered(p)  # computes on its values in the block
            entered.append([p, held, ph, given])
        yield
        if modifier_rank is not None:
            import torch.distributed as dist
            many = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            for e in entered:
                p, held, _ph, given = e
                if many:
                    dist.broadcast(p.data, src=modifier_rank)  # same shape on every rank: a collective
                if tuple(p.data.shape) != tuple(held.shape):
                    # resized (transformers' resize_token_embeddings swaps .data): no longer Init's
                    with LOCK:
                        pop_held(p)
                    allow_copies(p)
                    held.owner._forget(held)
                    e[2] = None
                elif not _same_bits(p.data, given):
                    held.owner._rewrite(held, p.data)
    finally:
        for p, _held, ph, _given in entered:
            if ph is not None:
                p.data = ph
                mark_released(p, held=True)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (same shape and dtype) hold the same bytes: ``torch.equal`` calls
    NaN unequal to itself and -0.0 equal to 0.0, so a changed sign of zero would not be kept."""
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


class _GuardMode(TorchFunctionMode):
    """[Note: late initialisation] Code may change a parameter after its module's constructor
    returned (a Hugging Face ``post_init`` re-initialising weights, a subclass changing its
    parent's weight). While ``Init`` is active, any torch function that receives a moved-out
    parameter, or reads its ``.data``, first brings that parameter's values back; it stays in
    memory (so ``.data`` aliases keep working) until another moved-out parameter is needed or
    the outermost constructor returns, and is then moved out again with the changes. One
    parameter at a time is in memory, and the values equal those of a build without ``Init``."""

    def __init__(self, owner: "Init"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):  # metadata (shape, grad_fn, ...) needs no values; .data does
            attr = attribute_of(func)
            if name == "__get__" and attr == "shape" and args and isinstance(args[0], nn.Parameter):
                held = HELD.get(args[0])
                if held is not None and held.owner is self.owner:
                    # the true shape, not the placeholder's (transformers' resize_token_embeddings set
                    # config.vocab_size from it: 0); no values needed
                    return held.shape
            if attr != "data":
                return func(*args, **kwargs)
        for a in itertools.chain(args, kwargs.values()):
            if isinstance(a, nn.Parameter) and a in HELD and HELD[a].owner is self.owner:
                self.owner._bring_back(a)
        return func(*args, **kwargs)


class Init:
    """Context manager: build modules with their parameters partitioned away as they are made.

    Args:
        config: a DeepSpeed-format config (dict or JSON path); its
            ``zero_optimization.offload_param`` block chooses where values wait: ``nvme`` →
            swap files under ``nvme_path`` (host memory stays flat), else host memory.
        enabled: False makes the context a no-op (like DeepSpeed's ``zero.Init(enabled=...)``).

    Attributes:
        held_bytes_host: bytes currently held in host memory.
        held_bytes_nvme: bytes written to swap files.

    Raises:
        zeroinf.config.ConfigError: an invalid config; on entering, an ``offload_param.nvme_path``
            that cannot hold swap files (the message says why).
    """

    _active: Optional["Init"] = None

    def __init__(self, config: Any = None, *, enabled: bool = True):
        self.enabled = enabled
        self.device = "none"
        self.nvme_path: Optional[str] = None
        self._verify = True  # aio.verify_checksums
        if config is not None:
            from zeroinf.config import parse_config
            parsed = parse_config(config)
            off = parsed.zero_optimization.offload_param
            self.device, self.nvme_path = off.device, off.nvme_path
            self._verify = parsed.aio.verify_checksums
        self._swapper = None
        self._shown = None  # the bar of bytes moved to NVMe (zeroinf.progress), while a block is active
        self._dir: Optional[str] = None
        self._seq = 0
        self._outstanding = 0
        self.held_bytes_host = 0
        self.held_bytes_nvme = 0
        self._patched: List[Tuple[type, Any, Any]] = []  # (class, our __init__, its own)
        self._building: List[nn.Module] = []
        self._mode: Optional[_GuardMode] = None
        self._back: Optional[Tuple[nn.Parameter, int]] = None  # the parameter brought back, its seq
        self._registered: Dict[str, Tuple[int, torch.dtype]] = {}  # swap key -> (numel, dtype)

    # --- context ----------------------------------------------------------------------------
    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        if Init._active is not None:
            raise RuntimeError("zeroinf.Init: contexts do not nest")
        if self.device == "nvme":  # before anything is patched: a failure here leaves nothing behind
            from zeroinf.config import ConfigError
            from zeroinf.io import TensorSwapper
            from zeroinf.io.probe import dir_problem
            problem = dir_problem(self.nvme_path, create=True)
            if problem is not None:
                raise ConfigError("zero_optimization.offload_param.nvme_path", f"{self.nvme_path!r} {problem}")
            self._dir = os.path.abspath(tempfile.mkdtemp(prefix="zeroinf_init_", dir=self.nvme_path))
            self._swapper = TensorSwapper(self._dir, checksum=self._verify)
            self._shown = progress.bar("zeroinf.Init: moving parameters to NVMe", unit="B", unit_scale=True)
        Init._active = self
        self._orig_init_subclass = nn.Module.__dict__.get("__init_subclass__")
        for cls in _all_module_classes():
            self._patch(cls)
        owner = self

        def init_subclass(cls, **kw):
            super(nn.Module, cls).__init_subclass__(**kw)
            owner._patch(cls)

        nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._mode = _GuardMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        try:
            self._mode.__exit__(*exc)
            self._put_back()
        finally:
            for cls, wrapper, orig in self._patched:
                # a class decorator applied after the patch (transformers' MoE classes, imported
                # lazily inside the block) wrapped our wrapper: leave both, ours is inert outside
                # a block; taking its __wrapped__ removed the decorator's __init__ for the rest
                # of the process ("'MixtralExperts' object has no attribute 'config'")
                if cls.__dict__.get("__init__") is wrapper:
                    cls.__init__ = orig
            self._patched.clear()
            if self._orig_init_subclass is None:
                del nn.Module.__init_subclass__
            else:
                nn.Module.__init_subclass__ = self._orig_init_subclass
            Init._active = None
            if self._swapper is not None:
                self._swapper.wait()
            if self._shown is not None:
                self._shown.close()
                self._shown = None

    def _patch(self, cls: type) -> None:
        """Wrap ``cls.__init__`` (its own, not an inherited one) so that a module built while a
        block is active has its values moved out once its outermost constructor returns. The
        wrapper looks up the active block at each call: one left in place after the block
        (see ``__exit__``) only calls the original."""
        orig = cls.__dict__.get("__init__")
        if orig is None or getattr(orig, "_zeroinf_init_wrapper", False):
            return

        def wrapped(module, *args, **kwargs):
            owner = Init._active
            if owner is None:
                return orig(module, *args, **kwargs)
            outermost = not any(m is module for m in owner._building)
            first = owner._seq_next()
            owner._building.append(module)
            try:
                orig(module, *args, **kwargs)
            finally:
                owner._building.pop()
            if outermost and Init._active is owner:
                owner._move_out(module)
                if not owner._building:
                    owner._put_back()
                owner._drop_orphans(module, first)

        functools.update_wrapper(wrapped, orig)
        wrapped._zeroinf_init_wrapper = True
        cls.__init__ = wrapped
        self._patched.append((cls, wrapped, orig))

    # --- moving values ------------------------------------------------------------------------
    def _move_out(self, module: nn.Module) -> None:
        if module._parameters and not getattr(module, "_zeroinf_held_hook", False):
            module._register_state_dict_hook(held_state_dict_hook)
            module._register_load_state_dict_pre_hook(held_load_pre_hook, with_module=True)
            module.register_forward_pre_hook(held_forward_pre_hook)
            module._zeroinf_held_hook = True
        for p in module._parameters.values():
            if p is None or p in HELD or p.numel() == 0 or (self._back is not None and p is self._back[0]):
                continue
            if p.is_meta:  # no values to move: its loader (transformers' from_pretrained) puts them in later
                continue
            self._move_one(p)

    def _move_one(self, p: nn.Parameter, seq: Optional[int] = None) -> None:
        """Move ``p``'s values out (under a new sequence number, or ``seq`` when put back)."""
        data = p.detach().to("cpu").contiguous()
        if seq is None:
            seq, self._seq = self._seq, self._seq + 1
        held = Held(f"init/p{seq}", seq, p.shape, p.dtype, self)
        if self._swapper is not None:
            spec = (data.numel(), data.dtype)
            if self._registered.get(held.key, spec) != spec:  # put back resized or cast (resize_token_embeddings)
                held.key = f"init/p{seq}/{spec[0]}x{str(spec[1]).split('.')[-1]}"
            if held.key not in self._registered:
                self._swapper.register(held.key, *spec)
                self._registered[held.key] = spec
            self._swapper.swap_out([(held.key, data)], async_op=False)
            self.held_bytes_nvme += data.numel() * data.element_size()
            if self._shown is not None:
                self._shown.update(data.numel() * data.element_size())
        else:
            held.host = data.clone() if data.data_ptr() == p.data_ptr() else data
            self.held_bytes_host += data.numel() * data.element_size()
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        # [Note: held placeholders refuse compute] As a released stage-3 parameter does (see
        # released.py), a held one refuses compute outside the Init block: p.sum() gave 0 and
        # torch.nn.init.normal_(p) changed nothing, silently. Inside the block _GuardMode
        # brings the values back first; pop_held gives the class back.
        mark_released(p, held=True)
        p.ds_shape, p.ds_numel = held.shape, held.shape.numel()  # DeepSpeed's names, as for a managed parameter
        refuse_copies(p)
        held.finalizer = weakref.finalize(p, self._forget, held)
        with LOCK:
            HELD[p] = held
        self._outstanding += 1

    def _bring_back(self, p: nn.Parameter) -> None:
        if self._back is not None and self._back[0] is not p:
            self._put_back()
        with LOCK:
            held = pop_held(p)
        allow_copies(p)
        p.data = held.owner._take(held).to(p.device)
        self._back = (p, held.seq)

    def _put_back(self) -> None:
        back, self._back = self._back, None
        if back is not None:
            self._move_one(*back)

    def _seq_next(self) -> int:
        """Sequence number the next moved-out parameter will get."""
        return self._seq

    def _drop_orphans(self, module: nn.Module, first: int) -> None:
        """Forget parameters moved out while ``module`` was built that it no longer holds (a
        weight replaced by a tied one), so their values are not kept for nobody."""
        if self._building:  # only when an outermost model-level constructor returns
            return
        reachable = {p: None for _, p in module.named_parameters(remove_duplicate=False)}
        with LOCK:
            orphans = [p for p, h in HELD.items() if h.owner is self and h.seq >= first and p not in reachable]
            dropped = [pop_held(p) for p in orphans]
        for p, h in zip(orphans, dropped):
            allow_copies(p)
            self._forget(h)

    def _forget(self, held: Held) -> None:
        """Drop one parameter's held values unread (its module let it go)."""
        if held.host is not None:
            self.held_bytes_host -= held.nbytes
            held.host = None
        else:
            self.held_bytes_nvme -= held.nbytes
        self._one_less()

    def _one_less(self) -> None:
        """One held parameter fewer; after the ``with`` block the last one closes the swap files."""
        self._outstanding -= 1
        if self._outstanding == 0 and self._swapper is not None and Init._active is not self:
            self._swapper.close()
            self._swapper = None
            shutil.rmtree(self._dir, ignore_errors=True)

    def _peek(self, held: Held) -> torch.Tensor:
        """A copy of the values held for one parameter (CPU, held dtype, rounded through its
        placeholder's casts: [Note: casts of held parameters]); they stay held."""
        if held.host is not None:
            out = held.host.clone()
        else:
            out = torch.empty(held.shape, dtype=held.dtype)
            self._swapper.swap_in([(held.key, out.view(-1))], async_op=False)
        return rounded(held, out)

    def _rewrite(self, held: Held, values: torch.Tensor) -> None:
        """Replace the values held for one parameter (same shape; cast to the held dtype)."""
        data = values.detach().to("cpu", held.dtype).reshape(held.shape).contiguous()
        if held.host is not None:
            held.host.copy_(data)
        else:
            self._swapper.swap_out([(held.key, data)], async_op=False)

    def _take(self, held: Held) -> torch.Tensor:
        if held.host is not None:
            out, held.host = held.host, None
            self.held_bytes_host -= out.numel() * out.element_size()
        else:
            out = torch.empty(held.shape, dtype=held.dtype)
            self._swapper.swap_in([(held.key, out.view(-1))], async_op=False)
            self.held_bytes_nvme -= out.numel() * out.element_size()
        self._one_less()
        return rounded(held, out.view(held.shape))


def _all_module_classes() -> List[type]:
    seen, todo = [], [nn.Module]
    while todo:
        c = todo.pop()
        for s in c.__subclasses__():
            if s not in seen:
                seen.append(s)
                todo.append(s)
    return seen


