"""The fused gradient-bucket pass (zeroinf.ops.cuda_grad, csrc/cuda/).

Three groups:
* the torch implementation on CPU against an independent float64 / numpy reference (always run);
* the CUDA kernel against the same reference and the torch implementation (skipped, with the
  reason, unless a GPU and a CUDA build of torch are present: bench/gpu_check.sh runs them there);
* a compile check of the sources with nvcc / g++ (skipped when nvcc is not on PATH).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from zeroinf.ops import OpUnavailableError, load_op, op_status
from zeroinf.ops.cuda_grad import grad_bucket_pass, grad_bucket_pass_reference
from zeroinf.ops.specs import csrc_root, cuda_blockers

HAS_CUDA = torch.version.cuda is not None and torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA,
    reason=f"needs a CUDA GPU and a CUDA build of torch (torch {torch.__version__}, "
           f"torch.version.cuda={torch.version.cuda}, cuda available={torch.cuda.is_available()})")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PAIRS = [(a, b) for a in DTYPES for b in DTYPES]
SIZES = [1, 7, 17, 4097]


# ---- independent reference (numpy / float64; no torch conversion involved) ---------------------

def _as_f64(t: torch.Tensor) -> np.ndarray:
    # bf16/fp16 -> fp32 is exact; fp32 -> float64 is exact.
    return t.detach().cpu().float().numpy().astype(np.float64).reshape(-1)


def _expected_bits(src: torch.Tensor, out_dtype: torch.dtype) -> np.ndarray:
    """Bit patterns of src converted to out_dtype with round-to-nearest-even (finite inputs)."""
    f32 = src.detach().cpu().float().numpy().reshape(-1)
    if out_dtype == torch.float32:
        return f32.view(np.uint32)
    if out_dtype == torch.float16:
        return f32.astype(np.float16).view(np.uint16)
    u = f32.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().reshape(-1)
    if t.dtype == torch.float32:
        return t.numpy().view(np.uint32)
    return t.view(torch.int16).numpy().view(np.uint16)


def _grad(n: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    g = torch.randn(n, dtype=torch.float32) * 3.0
    g[::5] *= 1e-3  # small magnitudes too, so fp16 outputs reach subnormals
    return g.to(dtype).to(device)


def _check_against_reference(grad, out, stats):
    vals = _as_f64(grad)
    expected_sq = float(np.sum(vals * vals))
    assert stats.sq_norm.dtype == torch.float32 and stats.sq_norm.dim() == 0
    assert stats.nonfinite.dtype == torch.int64 and stats.nonfinite.dim() == 0
    assert stats.sq_norm.item() == pytest.approx(expected_sq, rel=1e-5, abs=1e-30)
    assert stats.nonfinite.item() == 0
    np.testing.assert_array_equal(_bits(out), _expected_bits(grad, out.dtype))


# ---- torch implementation on CPU (the fallback) -------------------------------------------------

@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_fallback_matches_float64_reference(pair, n):
    grad = _grad(n, DTYPES[pair[0]])
    out = torch.full((n,), 7.0, dtype=DTYPES[pair[1]])
    stats = grad_bucket_pass(grad, out)
    _check_against_reference(grad, out, stats)


def test_fallback_large_bucket_norm_and_2d_shape():
    grad = _grad(1 << 20, torch.bfloat16).view(1024, 1024)
    out = torch.empty(1 << 20, dtype=torch.float32)
    stats = grad_bucket_pass(grad, out)
    _check_against_reference(grad, out, stats)


@pytest.mark.parametrize("in_dtype", list(DTYPES), ids=str)
def test_fallback_counts_inf_and_nan(in_dtype):
    grad = _grad(4097, DTYPES[in_dtype])
    grad[3], grad[100], grad[4096] = float("inf"), float("-inf"), float("nan")
    out = torch.empty(4097, dtype=torch.float32)
    stats = grad_bucket_pass(grad, out)
    assert stats.nonfinite.item() == 3
    assert torch.isnan(stats.sq_norm)  # inf^2 + nan
    assert torch.isinf(out[3]) and out[3] > 0 and torch.isinf(out[100]) and out[100] < 0
    assert torch.isnan(out[4096])
    finite = torch.isfinite(grad)
    np.testing.assert_array_equal(_bits(out[finite]), _expected_bits(grad[finite], torch.float32))

    grad[4096] = 1.0
    stats = grad_bucket_pass(grad, out)
    assert stats.nonfinite.item() == 2 and stats.sq_norm.item() == float("inf")


def test_fallback_overflowing_sum_is_not_counted_as_nonfinite():
    # Every value is finite but the fp32 sum of squares overflows: the count tells them apart.
    grad = torch.full((8,), 1e20, dtype=torch.float32)
    out = torch.empty(8, dtype=torch.bfloat16)
    stats = grad_bucket_pass(grad, out)
    assert stats.nonfinite.item() == 0
    assert stats.sq_norm.item() == float("inf")


def test_fallback_empty_bucket():
    stats = grad_bucket_pass(torch.empty(0), torch.empty(0, dtype=torch.bfloat16))
    assert stats.sq_norm.item() == 0.0 and stats.nonfinite.item() == 0


@pytest.mark.parametrize("bad,match", [
    ("numel", "out has 5 elements but grad has 6"),
    ("grad_dtype", "grad must be float32, bfloat16 or float16, got torch.float64"),
    ("out_dtype", "out must be float32, bfloat16 or float16, got torch.int32"),
    ("strided", "grad must be contiguous"),
    ("not_tensor", "out must be a torch.Tensor, got list"),
], ids=str)
def test_bad_input_names_the_culprit(bad, match):
    grad, out = torch.ones(6), torch.empty(6)
    if bad == "numel":
        out = torch.empty(5)
    elif bad == "grad_dtype":
        grad = grad.double()
    elif bad == "out_dtype":
        out = out.int()
    elif bad == "strided":
        grad = torch.ones(12)[::2]
    elif bad == "not_tensor":
        out = [0.0] * 6
    with pytest.raises((TypeError, ValueError), match=match):
        grad_bucket_pass(grad, out)
    with pytest.raises((TypeError, ValueError), match=match):
        grad_bucket_pass_reference(grad, out)


@pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour without CUDA")
def test_without_cuda_the_op_is_never_built_and_reports_why():
    why = "; ".join(cuda_blockers())
    assert why, "cuda_blockers() must give a reason on a machine without CUDA"
    assert cuda_blockers(aot=True)
    status = op_status("cuda")
    assert status["state"] == "fallback" and status["why"] == why
    with pytest.raises(OpUnavailableError, match="CUDA op 'cuda' not built"):
        load_op("cuda")
    with pytest.raises(OpUnavailableError):
        grad_bucket_pass(torch.ones(4), torch.empty(4), use_kernel=True)


# ---- the CUDA kernel -----------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("n", SIZES + [(1 << 22) + 5], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
@pytest.mark.parametrize("where", ["pinned", "device"])
def test_kernel_matches_reference(pair, n, where):
    grad = _grad(n, DTYPES[pair[0]], "cuda")
    kw = dict(dtype=DTYPES[pair[1]])
    out = torch.empty(n, **kw).pin_memory() if where == "pinned" else torch.empty(n, device="cuda", **kw)
    ref_out = torch.empty_like(out)
    stats = grad_bucket_pass(grad, out, use_kernel=True)
    ref = grad_bucket_pass_reference(grad, ref_out)
    torch.cuda.current_stream().synchronize()
    _check_against_reference(grad, out, stats)
    np.testing.assert_array_equal(_bits(out), _bits(ref_out))
    assert stats.sq_norm.item() == pytest.approx(ref.sq_norm.item(), rel=1e-5)


@needs_cuda
@pytest.mark.parametrize("pair", [("fp32", "fp32"), ("bf16", "fp32"), ("fp32", "bf16")], ids=str)
def test_kernel_unaligned_views_take_the_scalar_path(pair):
    # Offsets of one element break the 8/16-byte alignment the packed loads need.
    base = _grad(4099, DTYPES[pair[0]], "cuda")
    grad = base[1:4098]
    out_base = torch.empty(4098, dtype=DTYPES[pair[1]]).pin_memory()
    out = out_base[1:]
    stats = grad_bucket_pass(grad, out, use_kernel=True)
    torch.cuda.current_stream().synchronize()
    _check_against_reference(grad, out, stats)


@needs_cuda
@pytest.mark.parametrize("in_dtype", list(DTYPES), ids=str)
def test_kernel_counts_inf_and_nan(in_dtype):
    grad = _grad(100_003, DTYPES[in_dtype], "cuda")
    for i, v in ((0, "inf"), (77_777, "-inf"), (100_002, "nan"), (5, "nan")):
        grad[i] = float(v)
    out = torch.empty(100_003, dtype=torch.float32).pin_memory()
    stats = grad_bucket_pass(grad, out, use_kernel=True)
    torch.cuda.current_stream().synchronize()
    assert stats.nonfinite.item() == 4
    assert torch.isnan(stats.sq_norm).item()
    assert torch.equal(torch.isnan(out), torch.isnan(grad.cpu().float()))


@needs_cuda
def test_kernel_is_deterministic_and_does_not_synchronise():
    grad = _grad((1 << 24) + 1, torch.bfloat16, "cuda")
    out = torch.empty(grad.numel(), dtype=torch.float32).pin_memory()
    grad_bucket_pass(grad, out, use_kernel=True)  # build/load outside the sync check
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = grad_bucket_pass(grad, out, use_kernel=True)
        second = grad_bucket_pass(grad, out, use_kernel=True)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert first.sq_norm.item() == second.sq_norm.item()
    assert first.sq_norm.item() == pytest.approx(float(np.sum(_as_f64(grad) ** 2)), rel=1e-5)


@needs_cuda
def test_kernel_rejects_pageable_host_out():
    with pytest.raises(ValueError, match="pinned CPU memory"):
        grad_bucket_pass(torch.ones(8, device="cuda"), torch.empty(8), use_kernel=True)


# ---- the engine on a GPU with params and optimizer on NVMe ---------------------------------------

def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=176, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _infinity_config(nvme: Path) -> dict:
    """ZeRO-3, params and optimizer on NVMe, fp32, AdamW, clipping at 1.0."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(nvme), "pin_memory": True},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "pin_memory": True},
        },
    }


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (2, 64), generator=g).cuda() for _ in range(n)]


@needs_cuda
def test_three_steps_on_nvme_match_plain_training_on_the_gpu(tmp_path):
    import copy

    import zeroinf

    model = _tiny_llama()
    ref = copy.deepcopy(model).cuda()
    opt = torch.optim.AdamW(ref.parameters(), lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    engine, *_ = zeroinf.initialize(model=model, model_parameters=model.parameters(),
                                    config=_infinity_config(tmp_path))
    *train, probe = _batches(4)
    for step, x in enumerate(train, 1):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        ref_loss = ref(input_ids=x, labels=x).loss
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-3), f"step {step}"
    with torch.no_grad():  # the third update shows in the next forward
        assert engine(input_ids=probe, labels=probe).loss.item() == pytest.approx(
            ref(input_ids=probe, labels=probe).loss.item(), abs=1e-3)


@needs_cuda
def test_training_steps_do_not_synchronise_the_device(tmp_path):
    import warnings

    import zeroinf

    model = _tiny_llama()
    engine, *_ = zeroinf.initialize(model=model, model_parameters=model.parameters(),
                                    config=_infinity_config(tmp_path))
    syncs = []
    for step, x in enumerate(_batches(3), 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if step > 1:  # step 1 records the module order and sets up buffers
                torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs += [f"step {step}: {w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    assert not syncs, f"{len(syncs)} synchronising CUDA calls in steps 2-3: {syncs[:5]}"


# ---- compile check -------------------------------------------------------------------------------

def _cuda_include_dir():
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME", ""), str(Path(nvcc).resolve().parent.parent) if nvcc else "",
                  "/usr/local/cuda"]
    for c in candidates:
        if c and Path(c, "include", "cuda_runtime_api.h").exists():
            return Path(c, "include")
    return None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_sources_compile_with_nvcc_and_gxx(tmp_path):
    """grad_bucket.cu with plain nvcc (no torch headers), warnings as errors, with the flags torch
    adds; then bindings.cpp syntax-checked against the installed torch headers."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    src = csrc_root() / "cuda"
    arch = os.environ.get("ZEROINF_TEST_CUDA_ARCH", "80")
    cmd = ["nvcc", "-std=c++17", "-O3", *COMMON_NVCC_FLAGS, "-Werror", "all-warnings",
           f"-gencode=arch=compute_{arch},code=sm_{arch}", "-c", str(src / "grad_bucket.cu"),
           "-o", str(tmp_path / "grad_bucket.o")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    assert (tmp_path / "grad_bucket.o").stat().st_size > 0

    cuda_inc = _cuda_include_dir()
    if cuda_inc is None or shutil.which("g++") is None:
        pytest.skip("CUDA headers or g++ not found: bindings.cpp not checked")
    incs = []
    if not any(Path(p, "c10/cuda/impl/cuda_cmake_macros.h").exists() for p in include_paths()):
        # A CPU build of torch ships the c10/cuda headers without this generated one.
        stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        incs += ["-isystem", str(tmp_path / "stub")]
    for p in [*include_paths(), str(cuda_inc), sysconfig.get_paths()["include"]]:
        incs += ["-isystem", p]
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", *incs,
           "-DTORCH_EXTENSION_NAME=zeroinf_cuda_check", "-DTORCH_API_INCLUDE_EXTENSION_H",
           str(src / "bindings.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
