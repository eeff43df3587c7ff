"""The fused Adam/AdamW step over flat buffers: the C++ op, and the pure-PyTorch reference.

:func:`adam_step` is what :class:`zeroinf.optim.CPUAdam` and the ZeRO runtime's optimizer call
for each parameter or sub-group. It runs the C++ op (``csrc/adam``; AVX-512, AVX2 or scalar,
chosen at run time) and falls back to :func:`adam_step_reference` — the same arithmetic in
PyTorch ops, also the tests' second reference — only when ops are unavailable
(``ZEROINF_DISABLE_OPS=1`` or no compiler), after one warning. A failed build raises
:class:`zeroinf.ops.OpBuildError`.

``ZEROINF_ADAM_ISA=avx512|avx2|scalar`` (read at every call) forces one instruction-set path,
``auto`` or unset takes the widest this CPU supports. All paths give the same bits.

bf16 moments: ``exp_avg`` and ``exp_avg_sq`` may both be bf16. They are read exactly, updated in
fp32 and written back with stochastic rounding (:func:`round_bf16_stochastic`), whose random bits
are a hash of (``sr_seed``, ``step``, element index) and nothing else: the same call gives the
same bits on every path, thread count and run, so a resumed run repeats the rounding exactly.
"""
from __future__ import annotations

import math
import operator
import os
from typing import NamedTuple, Optional, Sequence

import torch

from ..ops.loader import try_load_op

__all__ = ["AdamHyper", "adam_step", "adam_step_groups", "adam_step_list", "adam_step_reference", "isa_info",
           "limit_thread_parallelism", "load_adam_op", "round_bf16_stochastic", "round_bf16_stochastic_reference",
           "stream_rmw", "ISA_ENV"]

#: Environment variable that forces an instruction-set path of the C++ op.
ISA_ENV = "ZEROINF_ADAM_ISA"
_ISAS = ("auto", "avx512", "avx2", "scalar")
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_FALLBACK = "the pure-PyTorch Adam (zeroinf.optim.adam_step_reference)"


def load_adam_op():
    """Build (on first use) and load the C++ Adam op now; return it, or None when ops are off.

    Optimizers call this at construction, as DeepSpeedCPUAdam does, so the first-use compile
    (about 30 s on 2 cores, cached afterwards) happens at set-up instead of inside the first timed
    step. Returns None, with the loader's one warning, where the op cannot be built and
    :func:`adam_step` falls back to the pure-PyTorch Adam.
    """
    return try_load_op("adam", _FALLBACK)


def _forced_isa() -> str:
    isa = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if isa not in _ISAS:
        raise ValueError(f"{ISA_ENV}={isa!r}: expected one of {', '.join(_ISAS)}")
    return isa


def _check(name: str, t, numel: Optional[int], dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the update is written in place; a contiguous "
                         f"copy would lose it)")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, params has {numel}")


def _check_all(params, grads, exp_avg, exp_avg_sq, params_out, sfx: str = "") -> None:
    _check("params" + sfx, params, None, (torch.float32,))
    n = params.numel()
    _check("grads" + sfx, grads, n, _GRAD_DTYPES)
    _check("exp_avg" + sfx, exp_avg, n, _MOMENT_DTYPES)
    _check("exp_avg_sq" + sfx, exp_avg_sq, n, (exp_avg.dtype,))
    if exp_avg.dtype == torch.bfloat16 and n >= 1 << 32:
        raise ValueError(f"exp_avg{sfx}: bf16 moments allow fewer than 2^32 elements per tensor, got {n}")
    if params_out is not None:
        _check("params_out" + sfx, params_out, n, _OUT_DTYPES)


def adam_step(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              adamw_mode: bool = True, bias_correction: bool = True, grad_scale: float = 1.0,
              params_out: Optional[torch.Tensor] = None, sr_seed: int = 0) -> None:
    """One Adam/AdamW step, in place, over flat contiguous CPU buffers of equal numel.

    Per element, in float32 (Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
    Algorithm 2; the operation order of ``torch.optim.AdamW``)::

        g = grads / grad_scale
        p = p * (1 - lr * weight_decay)              if adamw_mode
        g = g + weight_decay * p                     otherwise (L2, torch.optim.Adam)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
        params_out = p.to(params_out.dtype)          if params_out is given

    with ``bc1 = 1 - beta1**step`` and ``bc2 = 1 - beta2**step`` (1 when ``bias_correction`` is
    False). Agrees with ``torch.optim.AdamW(foreach=False)`` to float rounding (about 1e-7 per
    step on unit-scale parameters; the result is not bit-identical to torch because
    ``1/sqrt(bc2)`` is folded into one multiply).

    Args:
        params: fp32 master parameters, any shape, contiguous; updated in place.
        grads: fp32, bf16 or fp16 gradients (read only).
        exp_avg, exp_avg_sq: first and second moments, both fp32 or both bf16 (fewer than 2^32
            elements; written with stochastic rounding, see the module docstring); updated in place.
        step: the 1-based step number after increment (``torch.optim`` convention).
        lr, beta1, beta2, eps, weight_decay: the usual hyper-parameters (Python floats).
        adamw_mode: decoupled weight decay (AdamW) if True, L2 added to the gradient if False.
        bias_correction: divide by ``1 - beta**step`` as torch does.
        grad_scale: the gradients are divided by it first (fp16 loss scaling folded in).
        params_out: optional bf16/fp16 buffer receiving the updated parameters, bit-equal to
            ``params.to(params_out.dtype)`` (round to nearest even; NaN as torch casts it).
        sr_seed: with bf16 moments, the seed of their stochastic rounding (an int taken modulo
            2^64); the caller gives each tensor its own. Ignored with fp32 moments.

    Raises:
        ValueError: a buffer is not a contiguous CPU tensor of the required dtype and numel (the
            message names it), ``step < 1``, ``grad_scale`` not finite and positive, or
            ``ZEROINF_ADAM_ISA`` names a path this CPU cannot run.
        zeroinf.ops.OpBuildError: the C++ op failed to build.
    """
    _check_all(params, grads, exp_avg, exp_avg_sq, params_out)
    step = int(step)
    if step < 1:
        raise ValueError(f"step must be >= 1 (the step number after increment), got {step}")
    if not (math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"grad_scale must be finite and > 0, got {grad_scale}")
    isa = _forced_isa()
    op = try_load_op("adam", _FALLBACK)
    if op is None:
        adam_step_reference(params, grads, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
                            eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                            bias_correction=bias_correction, grad_scale=grad_scale, params_out=params_out,
                            sr_seed=sr_seed)
        return
    op.adam_step(params, grads, exp_avg, exp_avg_sq, params_out, step, float(lr), float(beta1), float(beta2),
                 float(eps), float(weight_decay), bool(adamw_mode), bool(bias_correction), float(grad_scale),
                 isa, _as_int64(sr_seed))


class AdamHyper(NamedTuple):
    """One param group's hyper-parameters for :func:`adam_step_groups` (as in :func:`adam_step`)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool = True
    bias_correction: bool = True


def adam_step_list(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
                   steps: Sequence[int], lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, adamw_mode: bool = True, bias_correction: bool = True,
                   grad_scale: float = 1.0,
                   params_outs: Optional[Sequence[Optional[torch.Tensor]]] = None) -> None:
    """:func:`adam_step` over lists of tensors in one call; :func:`adam_step_groups` with one group.

    Element ``i`` of every list describes one tensor, stepped with ``steps[i]``; the result is
    exactly that of calling :func:`adam_step` on each in list order. All tensors are checked
    before any is written.

    Raises:
        ValueError: lists of different lengths, or a bad buffer (named with its index, e.g.
            ``exp_avg[3]``); see :func:`adam_step`.
    """
    adam_step_groups(params, grads, exp_avgs, exp_avg_sqs, steps=steps, group_of=[0] * len(params),
                     groups=[AdamHyper(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction)],
                     grad_scale=grad_scale, params_outs=params_outs)


def adam_step_groups(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                     exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
                     steps: Sequence[int], group_of: Sequence[int], groups: Sequence[AdamHyper],
                     grad_scale: float = 1.0,
                     params_outs: Optional[Sequence[Optional[torch.Tensor]]] = None) -> None:
    """:func:`adam_step` over tensors of several param groups in one call (``CPUAdam.step``).

    Tensor ``i`` (element ``i`` of every list) is stepped with step number ``steps[i]`` and the
    hyper-parameters ``groups[group_of[i]]``. The C++ op runs the whole call as one parallel
    region over a flat list of cache-sized chunks of all tensors; the result is exactly that of
    calling :func:`adam_step` on each tensor in list order (tensors whose memory overlaps an
    earlier one's are stepped after it). All tensors are checked before any is written.

    Raises:
        ValueError: lists of different lengths, a ``group_of`` entry out of range, or a bad buffer
            (named with its index, e.g. ``exp_avg[3]``); see :func:`adam_step`.
    """
    k = len(params)
    outs = list(params_outs) if params_outs is not None else [None] * k
    steps = [int(s) for s in steps]
    group_of = [int(g) for g in group_of]
    groups = [AdamHyper(*(float(x) for x in g[:5]), *(bool(x) for x in g[5:])) for g in groups]
    lens = [len(grads), len(exp_avgs), len(exp_avg_sqs), len(outs), len(steps), len(group_of)]
    if any(n != k for n in lens):
        raise ValueError(f"params, grads, exp_avgs, exp_avg_sqs, params_outs, steps and group_of must have the "
                         f"same length; got {[k] + lens}")
    if not (math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"grad_scale must be finite and > 0, got {grad_scale}")
    isa = _forced_isa()
    op = try_load_op("adam", _FALLBACK)
    if op is not None:  # the op checks every tensor itself, naming it with its index
        op.adam_step_list(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), outs, steps, group_of,
                          [tuple(g) for g in groups], float(grad_scale), isa)
        return
    for i in range(k):
        _check_all(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], outs[i], f"[{i}]")
        if exp_avgs[i].dtype != torch.float32:
            raise ValueError(f"exp_avgs[{i}] must be float32 in the list form (bf16 moments are stepped one "
                             "tensor at a time, with adam_step and its sr_seed)")
        if steps[i] < 1:
            raise ValueError(f"step[{i}] must be >= 1 (the step number after increment), got {steps[i]}")
        if not 0 <= group_of[i] < len(groups):
            raise ValueError(f"group_of[{i}] is {group_of[i]}; there are {len(groups)} groups")
    for i in range(k):
        adam_step_reference(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], step=steps[i],
                            grad_scale=grad_scale, params_out=outs[i], **groups[group_of[i]]._asdict())


def step_counted(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                 exp_avg_sqs: Sequence[torch.Tensor], params_outs: Sequence[Optional[torch.Tensor]],
                 step_counts: Sequence[torch.Tensor], group_of: Sequence[int], groups: Sequence[AdamHyper]) -> bool:
    """:func:`adam_step_groups` in one op call with ``torch.optim``'s step counters, when it can.

    ``step_counts[i]`` is tensor ``i``'s ``state["step"]`` (a one-element float32 CPU tensor
    holding the whole number of steps taken); tensor ``i`` is stepped with that count + 1 and the
    counts are incremented after every tensor is stepped, all inside the op, so a step of many
    small tensors costs no Python per tensor beyond building the lists.

    Returns:
        True when stepped and counted; False, with nothing stepped or counted, when the C++ op is
        unavailable or a buffer is not contiguous: the caller then steps the lists its general way.

    Raises:
        ValueError: a bad buffer, count or group index, named by its list index, before anything
            is written; ``ZEROINF_ADAM_ISA`` names a path this CPU cannot run.
    """
    op = try_load_op("adam", _FALLBACK)
    if op is None:
        return False
    return op.adam_step_counted(params, grads, exp_avgs, exp_avg_sqs, params_outs, step_counts, group_of,
                                groups, 1.0, _forced_isa()) < 0


@torch.no_grad()
def adam_step_reference(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor,
                        exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                        eps: float, weight_decay: float, adamw_mode: bool = True,
                        bias_correction: bool = True, grad_scale: float = 1.0,
                        params_out: Optional[torch.Tensor] = None, sr_seed: int = 0) -> None:
    """:func:`adam_step` written with PyTorch ops: the runtime fallback and the tests' reference.

    Same arguments, formula and errors as :func:`adam_step`; float32 arithmetic in the same order
    as the C++ kernel, so the two agree to about one rounding step (bf16 moments: the same random
    bits, so they agree to about one bf16 step where the fp32 values differ by a rounding).
    """
    _check_all(params, grads, exp_avg, exp_avg_sq, params_out)
    if exp_avg.dtype == torch.bfloat16:
        m, v = exp_avg.float(), exp_avg_sq.float()
        adam_step_reference(params, grads, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction,
                            grad_scale=grad_scale, params_out=params_out)
        r = _sr_bits(m.numel(), _sr_key(sr_seed, step))
        exp_avg.view(-1).copy_(_round_bf16_bits(m.view(-1), r & 0xFFFF))
        exp_avg_sq.view(-1).copy_(_round_bf16_bits(v.view(-1), r >> 16))
        return
    bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
    g = grads.float()
    if grad_scale != 1.0:
        g = g / grad_scale
    if weight_decay != 0.0:
        if adamw_mode:
            params.mul_(1.0 - lr * weight_decay)
        else:
            g = g + params * weight_decay
    exp_avg.mul_(beta1).add_(g * (1.0 - beta1))
    exp_avg_sq.mul_(beta2).add_(g * (1.0 - beta2) * g)
    denom = exp_avg_sq.sqrt().mul_(1.0 / math.sqrt(bc2)).add_(eps)
    params.sub_((exp_avg / denom).mul_(lr / bc1))
    if params_out is not None:
        params_out.copy_(params)


def _as_int64(seed: int) -> int:
    """``seed`` modulo 2^64 as a signed 64-bit int (what the op's int64 argument takes)."""
    u = operator.index(seed) & _U64
    return u - (1 << 64) if u >= 1 << 63 else u


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def _sr_key(seed: int, step: int) -> int:
    """The op's rounding key of (seed, step): low 32 bits of splitmix64(splitmix64(seed) + step)
    (``sr_key`` in csrc/adam/cpu_adam.h)."""
    return _splitmix64((_splitmix64(operator.index(seed) & _U64) + int(step)) & _U64) & _U32


def _sr_bits(n: int, key: int) -> torch.Tensor:
    """32 random bits per element index 0..n-1 (int64 tensor): lowbias32(index XOR key), as
    ``hash_index`` in csrc/includes/simd.h; products are taken modulo 2^32."""
    x = torch.arange(n, dtype=torch.int64) ^ key
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _U32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _U32  # < 2^64 before the mask: int64 wraps, the low 32 bits are exact
    return x ^ (x >> 16)


def _round_bf16_bits(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 by adding the 16 random bits ``r16`` to its bits and truncating
    (csrc/includes/simd.h, ``store_sr``); NaN becomes 0xFFFF."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & _U32
    h = ((bits + r16) >> 16) & 0xFFFF
    h = torch.where(torch.isnan(x), torch.full_like(h, 0xFFFF), h)
    return (((h + 0x8000) & 0xFFFF) - 0x8000).to(torch.int16).view(torch.bfloat16)


def round_bf16_stochastic_reference(src: torch.Tensor, *, sr_seed: int, step: int) -> torch.Tensor:
    """:func:`round_bf16_stochastic` in PyTorch ops, bit-equal to the op: the fallback and the
    tests' reference."""
    _check("src", src, None, (torch.float32,))
    return _round_bf16_bits(src.view(-1), _sr_bits(src.numel(), _sr_key(sr_seed, step)) & 0xFFFF).view(src.shape)


def round_bf16_stochastic(src: torch.Tensor, *, sr_seed: int, step: int) -> torch.Tensor:
    """``src`` (fp32, contiguous CPU, fewer than 2^32 elements) rounded to bf16 stochastically:
    element i rounds up in magnitude with probability (its dropped 16 bits) / 2^16, so the
    expected result is ``src``; the random bits are those :func:`adam_step` uses for ``exp_avg``
    element i at (``sr_seed``, ``step``). Returns a new bf16 tensor of ``src``'s shape.

    Raises:
        ValueError: ``src`` is not a contiguous fp32 CPU tensor, or has 2^32 elements or more.
    """
    _check("src", src, None, (torch.float32,))
    if src.numel() >= 1 << 32:
        raise ValueError(f"src: fewer than 2^32 elements allowed, got {src.numel()}")
    op = try_load_op("adam", _FALLBACK)
    if op is None:
        return round_bf16_stochastic_reference(src, sr_seed=sr_seed, step=step)
    out = torch.empty(src.shape, dtype=torch.bfloat16)
    op.round_bf16_stochastic(src, out, _as_int64(sr_seed), int(step), _forced_isa())
    return out


def stream_rmw(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               params_out: Optional[torch.Tensor] = None) -> None:
    """The memory roof of :func:`adam_step`: the same loads and stores, one add per stream.

    Reads ``grads``, ``params``, ``exp_avg``, ``exp_avg_sq``; writes ``params + grads`` etc. back
    (and ``params_out``). Meaningless numbers: for bench/cpu_adam.py, which times it as the
    bandwidth ceiling of a single-pass Adam over the same bytes.

    Raises:
        ValueError: as :func:`adam_step`.
        zeroinf.ops.OpUnavailableError, zeroinf.ops.OpBuildError: the C++ op is unavailable.
    """
    from ..ops.loader import load_op

    _check_all(params, grads, exp_avg, exp_avg_sq, params_out)
    load_op("adam").stream_rmw(params, grads, exp_avg, exp_avg_sq, params_out, _forced_isa())


def isa_info() -> dict:
    """Instruction-set paths of the Adam op, for ``zeroinf report``; builds the op if needed.

    Returns:
        ``{"chosen": "avx512"|"avx2"|"scalar"|"torch", "forced": value of ZEROINF_ADAM_ISA or
        None, "unsupported": {path: reason, "" when it runs here}}``. ``chosen`` is "torch" when
        the op is unavailable and the pure-PyTorch reference runs.
    """
    forced = os.environ.get(ISA_ENV) or None
    op = try_load_op("adam", _FALLBACK)
    if op is None:
        return {"chosen": "torch", "forced": forced, "unsupported": {}}
    info = dict(op.isa_info())
    if forced and forced != "auto":
        info["chosen"] = forced
    info["forced"] = forced
    return info


def limit_thread_parallelism(n: int) -> Optional[int]:
    """Cap at ``n`` the threads of the parallel regions started from the calling thread: OpenMP
    (the Adam op, torch's element-wise and reduction ops) and MKL (torch's matmuls, where torch
    is built with MKL). A cap never raises the thread's count, and lasts as long as the thread:
    run the capped work on a thread of its own. Other threads, and the count
    ``torch.get_num_threads()`` gives in them, are left alone (``torch.set_num_threads`` called
    from a worker thread changes it in the main thread and in every thread started later,
    torch 2.13).

    For background threads that run beside the training loop's compute: two OpenMP teams of the
    full width on the same cores oversubscribe them, and the compute slows more than the
    background work gains (stage 3's optimizer in backward, ``bench/stage3_step.py``).

    Returns:
        ``torch.get_num_threads()`` in the calling thread afterwards: ``min(n, its count
        before)``. None when the C++ op is unavailable (``ZEROINF_DISABLE_OPS=1``, no compiler),
        and then nothing is capped.

    Raises:
        TypeError: ``n`` is not an ``int`` (``bool`` included).
        ValueError: ``n < 1``.
    """
    if isinstance(n, bool):
        raise TypeError(f"n must be an int, got bool {n!r}")
    try:
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"n must be an int, got {type(n).__name__} {n!r}") from None
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    op = try_load_op("adam", _FALLBACK)
    if op is None:
        return None
    return int(op.limit_thread_parallelism(min(n, torch.get_num_threads())))
