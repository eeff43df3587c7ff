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
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from zeroinf import progress

from .released import attribute_of, gathered_class, released_class, set_held_hooks

__all__ = ["Init", "init_shapes", "init_shapes_of", "init_dtype", "take_init_values", "held_values",
           "check_placeholders"]


@dataclass
class _Held:
    """One parameter moved out at construction: its shape/dtype and where its values are."""

    key: str
    seq: int
    shape: torch.Size
    dtype: torch.dtype
    owner: "Init"
    host: Optional[torch.Tensor] = None  # values kept in host memory (tiers none/cpu)
    finalizer: Any = None  # drops the values when the parameter is freed unread
    casts: List[torch.dtype] = field(default_factory=list)  # dtypes its placeholder took since (note_cast)

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * torch.empty((), dtype=self.dtype).element_size()


# Keyed by the Parameter object itself (a dict matches tensors by identity), never by id(), and
# weakly: an entry leaves when the manager takes its values, or when its parameter is freed (a
# module replaced before initialize: a resized embedding), and the values go with it.
_HELD: "WeakIdKeyDictionary[nn.Parameter, _Held]" = WeakIdKeyDictionary()
_LOCK = threading.Lock()


def _pop(p: nn.Parameter) -> _Held:
    """Take ``p``'s entry out of ``_HELD`` (call with ``_LOCK`` held); ``p`` gets its own class
    back ([Note: held placeholders refuse compute])."""
    held = _HELD.pop(p)
    held.finalizer.detach()
    p.__class__ = gathered_class(type(p))
    for name in ("ds_shape", "ds_numel"):  # whole again (a stage-3 manager sets its own)
        p.__dict__.pop(name, None)
    return held


def init_shapes(module: nn.Module) -> Dict[nn.Parameter, torch.Size]:
    """True shapes of ``module``'s parameters that ``Init`` moved out."""
    return init_shapes_of(module.parameters())


def init_shapes_of(params) -> Dict[nn.Parameter, torch.Size]:
    """True shapes of those of ``params`` that ``Init`` moved out."""
    with _LOCK:
        return {p: _HELD[p].shape for p in params if p in _HELD}


def swap_bytes_freed_by(params) -> Dict[str, int]:
    """Bytes of ``Init`` swap files that taking all of ``params`` frees, by swap folder: an
    ``Init`` removes its folder once the last parameter it holds is taken, so only blocks whose
    every held parameter is among ``params`` count. For ``initialize``'s disk check: those files
    are gone before the optimizer's are made (counted as not free, a disk with room would be
    refused after ``Init``)."""
    params = list(params)
    with _LOCK:
        mine: Dict[Init, int] = {}
        for p in params:
            held = _HELD.get(p)
            if held is not None and held.host is None:
                mine[held.owner] = mine.get(held.owner, 0) + 1
    return {owner._dir: owner.held_bytes_nvme for owner, n in mine.items()
            if owner._dir is not None and Init._active is not owner and n == owner._outstanding}


def note_cast(param: nn.Parameter, dtype: torch.dtype) -> None:
    """Record that held ``param``'s placeholder became ``dtype`` (``model.half()``, ``.to()``
    between the ``Init`` block and ``initialize``). [Note: casts of held parameters] The held
    values then pass through every dtype but the last, as a plain parameter's would:
    ``model.half().float()`` rounds them to fp16, as it does a plain parameter's. The last
    cast is the caller's: the engine keeps fp32 values of a model cast to bf16/fp16 as its
    masters ([Note: Init masters]). A no-op for a parameter ``Init`` does not hold."""
    with _LOCK:
        held = _HELD.get(param)
        if held is not None and dtype != (held.casts[-1] if held.casts else held.dtype):
            held.casts.append(dtype)


def init_dtype(param: nn.Parameter) -> Optional[torch.dtype]:
    """The dtype ``Init`` holds ``param``'s values in (as constructed, before any later cast of
    the module); None when ``Init`` does not hold it."""
    with _LOCK:
        held = _HELD.get(param)
    return held.dtype if held is not None else None


def take_init_values(param: nn.Parameter) -> torch.Tensor:
    """Return the values ``Init`` holds for ``param`` (a new CPU tensor) and forget them.

    Raises:
        KeyError: ``param`` was not created under ``Init`` (or was taken already).
        RuntimeError: ``param.data`` was replaced after the ``Init`` block (``p.data = t``): the
            held values would silently win over the new ones.
    """
    check_placeholders([param])
    with _LOCK:
        held = _pop(param)
    _allow_copies(param)
    return held.owner._take(held)


def check_placeholders(params) -> None:
    """Raise RuntimeError naming the first parameter ``Init`` holds whose ``.data`` is no longer
    its empty placeholder (``p.data = t`` after the block): the held values would silently win
    over the new ones. ``zeroinf.initialize``
    checks every parameter before it takes any value, so a refusal loses nothing."""
    for p in params:
        if p.data.numel() != 0:
            with _LOCK:
                held = _HELD.get(p)
            if held is not None:
                raise RuntimeError(f"zeroinf.Init: a held parameter (shape {tuple(held.shape)}) was given new data "
                                   f"(p.data = a tensor of shape {tuple(p.data.shape)}) after the Init block; Init "
                                   "still holds its old values, which initialize would take. Change weights inside "
                                   "zeroinf.gathered_parameters([p], modifier_rank=0), or load them after initialize; "
                                   "nothing was taken")


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
    with _LOCK:
        todo = [(p, _HELD[p]) for p in params if p in _HELD and Init._active is not _HELD[p].owner]
    entered = []  # [param, held, placeholder, values as given]
    try:
        for p, held in todo:
            ph = p.data
            given = held.owner._peek(held).to(device=ph.device, dtype=ph.dtype)
            p.data = given.clone()
            p.__class__ = gathered_class(type(p))  # computes on its values in the block
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
                    with _LOCK:
                        _pop(p)
                    _allow_copies(p)
                    held.owner._forget(held)
                    e[2] = None
                elif not torch.equal(p.data, given):
                    held.owner._rewrite(held, p.data)
    finally:
        for p, _held, ph, _given in entered:
            if ph is not None:
                p.data = ph
                p.__class__ = released_class(type(p), held=True)


def _rounded(held: _Held, values: torch.Tensor) -> torch.Tensor:
    """``values`` (held dtype) passed through every cast of the placeholder but the last."""
    if len(held.casts) < 2:
        return values
    out = values
    for dtype in held.casts[:-1]:
        out = out.to(dtype)
    return out.to(held.dtype)


def _refuse_copy(*_args):
    """``__deepcopy__`` / ``__reduce_ex__`` of a parameter ``Init`` moved out: its copy would
    hold the empty placeholder, with nothing to take its values from (``zeroinf.initialize`` on a
    deep-copied model failed on "'weight' must be 2-D"); raise ``TypeError`` saying what to do."""
    raise TypeError("zeroinf.Init: this parameter holds an empty placeholder until zeroinf.initialize takes its "
                    "values (Init keeps them in host memory or a swap file), so it cannot be deep-copied or pickled; "
                    "build a second model inside zeroinf.Init, or after zeroinf.initialize load the model's "
                    "state_dict() into a new one")


def _allow_copies(p: nn.Parameter) -> None:
    """Undo :func:`_refuse_copy` once ``p``'s values are no longer held."""
    for name in ("__deepcopy__", "__reduce_ex__"):
        p.__dict__.pop(name, None)


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
                held = _HELD.get(args[0])
                if held is not None and held.owner is self.owner:
                    # the true shape, not the placeholder's (transformers' resize_token_embeddings set
                    # config.vocab_size from it: 0); no values needed
                    return held.shape
            if attr != "data":
                return func(*args, **kwargs)
        for a in itertools.chain(args, kwargs.values()):
            if isinstance(a, nn.Parameter) and a in _HELD and _HELD[a].owner is self.owner:
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
            module._register_state_dict_hook(_held_state_dict_hook)
            module._register_load_state_dict_pre_hook(_held_load_pre_hook, with_module=True)
            module.register_forward_pre_hook(_held_forward_pre_hook)
            module._zeroinf_held_hook = True
        for p in module._parameters.values():
            if p is None or p in _HELD or p.numel() == 0 or (self._back is not None and p is self._back[0]):
                continue
            if p.is_meta:  # no values to move: its loader (transformers' from_pretrained) puts them in later
                continue
            self._move_one(p)

    def _move_one(self, p: nn.Parameter, seq: Optional[int] = None) -> None:
        """Move ``p``'s values out (under a new sequence number, or ``seq`` when put back)."""
        data = p.detach().to("cpu").contiguous()
        if seq is None:
            seq, self._seq = self._seq, self._seq + 1
        held = _Held(f"init/p{seq}", seq, p.shape, p.dtype, self)
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
        # brings the values back first; _pop gives the class back.
        p.__class__ = released_class(type(p), held=True)
        p.ds_shape, p.ds_numel = held.shape, held.shape.numel()  # DeepSpeed's names, as for a managed parameter
        for name in ("__deepcopy__", "__reduce_ex__"):  # copy and pickle look both up on the instance
            setattr(p, name, _refuse_copy)
        held.finalizer = weakref.finalize(p, self._forget, held)
        with _LOCK:
            _HELD[p] = held
        self._outstanding += 1

    def _bring_back(self, p: nn.Parameter) -> None:
        if self._back is not None and self._back[0] is not p:
            self._put_back()
        with _LOCK:
            held = _pop(p)
        _allow_copies(p)
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
        with _LOCK:
            orphans = [p for p, h in _HELD.items() if h.owner is self and h.seq >= first and p not in reachable]
            dropped = [_pop(p) for p in orphans]
        for p, h in zip(orphans, dropped):
            _allow_copies(p)
            self._forget(h)

    def _forget(self, held: _Held) -> None:
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

    def _peek(self, held: _Held) -> torch.Tensor:
        """A copy of the values held for one parameter (CPU, held dtype, rounded through its
        placeholder's casts: [Note: casts of held parameters]); they stay held."""
        if held.host is not None:
            out = held.host.clone()
        else:
            out = torch.empty(held.shape, dtype=held.dtype)
            self._swapper.swap_in([(held.key, out.view(-1))], async_op=False)
        return _rounded(held, out)

    def _rewrite(self, held: _Held, values: torch.Tensor) -> None:
        """Replace the values held for one parameter (same shape; cast to the held dtype)."""
        data = values.detach().to("cpu", held.dtype).reshape(held.shape).contiguous()
        if held.host is not None:
            held.host.copy_(data)
        else:
            self._swapper.swap_out([(held.key, data)], async_op=False)

    def _take(self, held: _Held) -> torch.Tensor:
        if held.host is not None:
            out, held.host = held.host, None
            self.held_bytes_host -= out.numel() * out.element_size()
        else:
            out = torch.empty(held.shape, dtype=held.dtype)
            self._swapper.swap_in([(held.key, out.view(-1))], async_op=False)
            self.held_bytes_nvme -= out.numel() * out.element_size()
        self._one_less()
        return _rounded(held, out.view(held.shape))


def _held_state_dict_hook(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata) -> None:
    """[Note: state_dict before initialize] Between the ``Init`` block and
    ``zeroinf.initialize`` a moved-out parameter is an empty placeholder, so
    ``model.state_dict()`` (``torch.save``, ``save_pretrained``) held empty tensors, silently.
    This hook, on every module whose parameters ``Init`` moved out, puts a copy of the held
    values in their place (read from the swap file on NVMe). Once the manager took a
    parameter's values it is no longer held and the hook leaves it to the engine's own."""
    if not _HELD:  # nothing held any more (after initialize): the hooks stay, at the cost of this test
        return
    for name, p in module._parameters.items():
        key = prefix + name
        if p is None or state_dict.get(key) is p:  # keep_vars=True: the parameter object stays
            continue
        with _LOCK:
            held = _HELD.get(p)
        if held is not None and key in state_dict:
            # in the placeholder's dtype, as a plain model's state_dict after model.half() (it gave
            # the fp32 values)
            state_dict[key] = held.owner._peek(held).to(p.dtype)


def _held_load_pre_hook(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata, strict,
                        missing_keys, unexpected_keys, error_msgs) -> None:
    """``model.load_state_dict(pretrained)`` between the ``Init`` block and ``zeroinf.initialize``
    failed on torch's shape check against the empty placeholders ("size mismatch ... the shape in
    current model is torch.Size([0])"), which blamed the checkpoint. Each held
    parameter's value is written into what ``Init`` holds for it, and torch is left an empty
    tensor to copy into the placeholder; a value of another shape is reported against the held
    shape, as torch reports it for a plain model. ``state_dict`` is torch's own shallow copy."""
    if not _HELD:
        return
    for name, p in module._parameters.items():
        key = prefix + name
        with _LOCK:
            held = _HELD.get(p) if p is not None else None
        if held is None or key not in state_dict:
            continue
        if local_metadata.get("assign_to_params_buffers"):  # it put the placeholder in as the value: all lost
            raise RuntimeError(f"zeroinf.Init: load_state_dict(..., assign=True) between the Init block and "
                               f"zeroinf.initialize would replace the held parameter '{key}' (shape "
                               f"{tuple(held.shape)}) by a plain tensor that Init does not hold; load with "
                               "assign=False (the default): the values are written into what Init holds")
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            continue  # torch reports it
        if tuple(value.shape) != tuple(held.shape):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                              f"the shape in current model is {held.shape}.")
        else:
            held.owner._rewrite(held, value)
        state_dict[key] = p.detach()  # the placeholder itself: torch's shape check and copy pass


def _held_forward_pre_hook(module: nn.Module, args) -> None:
    """A forward of a module whose parameter ``Init`` still holds (before ``zeroinf.initialize``)
    computed on the empty placeholder: "mat2 must be a matrix, got 1-D tensor". Raise saying so.
    On every forward of such a module for good: after initialize ``_HELD`` is empty and the
    first test returns."""
    if not _HELD:
        return
    for name, p in module._parameters.items():
        with _LOCK:
            held = _HELD.get(p) if p is not None else None
        if held is not None:
            raise RuntimeError(
                f"zeroinf.Init: parameter '{name}' (shape {tuple(held.shape)}) of this {type(module).__name__} is held by "
                "zeroinf.Init until zeroinf.initialize takes it, and is an empty placeholder until then, so this "
                "forward would compute on nothing: call zeroinf.initialize(model=...) first, or read the weights "
                "inside zeroinf.gathered_parameters(...)")


def _all_module_classes() -> List[type]:
    seen, todo = [], [nn.Module]
    while todo:
        c = todo.pop()
        for s in c.__subclasses__():
            if s not in seen:
                seen.append(s)
                todo.append(s)
    return seen


set_held_hooks(init_shapes_of, note_cast)  # released.py describes and casts held parameters through them
