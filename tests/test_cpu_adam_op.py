"""The fused CPU Adam op (zeroinf.optim.adam_step / adam_step_list): low-precision gradients and fused
16-bit outputs, the gradient scale, sub-ranges, every ISA path, bad buffers, the fallback when
ops are disabled, and the thread cap of the calling thread."""
import os
import subprocess
import sys
import threading

import pytest
import torch

import zeroinf.optim as zo
from zeroinf.ops import load_op
from cpu_adam_helpers import TOL, _run_pair, _supported_isas


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_low_precision_grads(grad_dtype):
    """bf16/fp16 grads are widened exactly: same result as torch stepping with grad.float()."""
    n = 1027
    init = torch.randn(n)
    grads = [torch.randn(n).to(grad_dtype) for _ in range(20)]
    p, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads, 1):
        zo.adam_step(p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    _, ref, _, _ = _run_pair(init, [g.float() for g in grads], dict(lr=1e-2, weight_decay=0.01))
    assert (p - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1_000_003])
def test_fused_output_bit_equal(n, out_dtype, monkeypatch):
    for isa in _supported_isas():
        monkeypatch.setenv(zo.ISA_ENV, isa)
        p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
        out = torch.full((n,), 7.0, dtype=out_dtype)
        for step in (1, 2):
            zo.adam_step(p, torch.randn(n), m, v, step=step, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.0, params_out=out)
        assert torch.equal(out.view(torch.int16), p.to(out_dtype).view(torch.int16)), isa


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_output_special_values(out_dtype, monkeypatch):
    """NaN, inf, signed zeros, subnormals, overflow and exact ties cast exactly as torch casts them."""
    bits = [0x7FC00000, 0xFFC00000, 0x7FC12345, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
            0x00000001, 0x80400000, 0x3F808000, 0x3F818000, 0x3F800FFF, 0x477FF000, 0x477FEFFF,
            0x33000000, 0x33000001, 0x387FE000, 0x387FF000, 0x38800000, 0x7F7FFFFF]
    master = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    master = torch.cat([master, torch.randn(37) * 1e4, torch.randn(37) * 1e-6])
    n = master.numel()
    for isa in _supported_isas():
        monkeypatch.setenv(zo.ISA_ENV, isa)
        p = master.clone()
        out = torch.zeros(n, dtype=out_dtype)
        # lr = 0, zero grads: the master keeps its bits and only the cast is exercised.
        zo.adam_step(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, beta1=0.9,
                     beta2=0.999, eps=1e-8, weight_decay=0.0, params_out=out)
        assert torch.equal(p.view(torch.int32), master.view(torch.int32)), isa
        assert torch.equal(out.view(torch.int16), master.to(out_dtype).view(torch.int16)), isa


def test_grad_scale_divides():
    n = 999
    init, g = torch.randn(n), torch.randn(n)
    p1, m1, v1 = init.clone(), torch.zeros(n), torch.zeros(n)
    p2, m2, v2 = init.clone(), torch.zeros(n), torch.zeros(n)
    kw = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    zo.adam_step(p1, g * 1024.0, m1, v1, grad_scale=1024.0, **kw)  # power of two: exact
    zo.adam_step(p2, g, m2, v2, **kw)
    assert torch.equal(p1, p2) and torch.equal(m1, m2) and torch.equal(v1, v2)


def test_sub_range_calls_equal_single_call():
    n = 3001
    init = torch.randn(n)
    grads = [torch.randn(n) for _ in range(5)]
    p = torch.nn.Parameter(init.clone())
    opt = zo.CPUAdam([p], lr=1e-2, weight_decay=0.01)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert opt.state[p]["step"].item() == 5
    q, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
    cuts = [0, 1000, 2017, n]
    step = 0
    for g in grads:
        step += 1
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            zo.adam_step(q[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], step=step, lr=1e-2, beta1=0.9, beta2=0.999,
                         eps=1e-8, weight_decay=0.01)
    assert step == 5
    assert torch.equal(q, p.detach()) and torch.equal(m, opt.state[p]["exp_avg"])


def test_isa_paths_bit_identical_and_fallback_close(monkeypatch):
    isas = _supported_isas()
    assert "scalar" in isas
    n = 4099
    init = torch.randn(n)
    grads = {dt: [torch.randn(n).to(dt) for _ in range(4)] for dt in (torch.float32, torch.bfloat16, torch.float16)}
    for gdt, gl in grads.items():
        for odt in (None, torch.bfloat16, torch.float16):
            results = {}
            for isa in isas + ["reference"]:
                monkeypatch.setenv(zo.ISA_ENV, "auto" if isa == "reference" else isa)
                p, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
                out = torch.zeros(n, dtype=odt) if odt is not None else None
                fn = zo.adam_step_reference if isa == "reference" else zo.adam_step
                for step, g in enumerate(gl, 1):
                    fn(p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                       adamw_mode=(step % 2 == 0), grad_scale=2.0 if gdt == torch.float16 else 1.0,
                       params_out=out)
                results[isa] = (p, m, v, out)
            base = results[isas[0]]
            for isa in isas[1:]:
                for x, y in zip(base, results[isa]):
                    if x is not None:
                        assert torch.equal(x.view(torch.int16 if x.dtype != torch.float32 else torch.int32),
                                           y.view(torch.int16 if y.dtype != torch.float32 else torch.int32)), (isa, gdt, odt)
            ref = results["reference"]
            assert (base[0] - ref[0]).abs().max().item() <= TOL
            assert (base[1] - ref[1]).abs().max().item() <= TOL


def test_forced_isa_errors(monkeypatch):
    p, m, v = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    monkeypatch.setenv(zo.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="ZEROINF_ADAM_ISA"):
        zo.adam_step(p, p.clone(), m, v, **kw)


@pytest.mark.parametrize("which", ["params", "grads", "exp_avg", "exp_avg_sq", "params_out"])
@pytest.mark.parametrize("fault", ["noncontig", "device", "dtype", "numel"])
def test_bad_buffers_raise_value_error_naming_them(which, fault):
    n = 12
    bufs = dict(params=torch.randn(n), grads=torch.randn(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n),
                params_out=torch.zeros(n, dtype=torch.bfloat16))
    good = bufs[which]
    if fault == "noncontig":
        bad = torch.zeros(2 * n, dtype=good.dtype)[::2]
    elif fault == "device":
        bad = torch.zeros(n, dtype=good.dtype, device="meta")
    elif fault == "dtype":
        bad = torch.zeros(n, dtype=torch.float64)
    else:
        bad = torch.zeros(n + 1, dtype=good.dtype)
    if which == "params" and fault == "numel":
        bad = torch.zeros(n + 1)  # then every other buffer mismatches; the first named is grads
    bufs[which] = bad
    before = {k: t.clone() for k, t in bufs.items() if t.device.type == "cpu"}
    name = "grads" if (which, fault) == ("params", "numel") else which
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match=name):
        zo.adam_step(bufs["params"], bufs["grads"], bufs["exp_avg"], bufs["exp_avg_sq"], step=1,
                     params_out=bufs["params_out"], **kw)
    # the C++ op checks on its own too (a caller that bypasses the Python wrapper)
    with pytest.raises(ValueError, match=name):
        load_op("adam").adam_step(bufs["params"], bufs["grads"], bufs["exp_avg"], bufs["exp_avg_sq"],
                                  bufs["params_out"], 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1.0, "auto")
    for k, t in before.items():  # nothing was written
        assert torch.equal(bufs[k], t), k


def test_disabled_ops_fall_back_with_one_warning():
    code = (
        "import warnings, torch, zeroinf.optim as zo\n"
        "torch.manual_seed(0)\n"
        "p=torch.nn.Parameter(torch.randn(50)); q=torch.nn.Parameter(p.detach().clone())\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    o=zo.CPUAdam([p], lr=1e-2, weight_decay=0.01); r=torch.optim.AdamW([q], lr=1e-2, foreach=False)\n"
        "    for _ in range(20):\n"
        "        g=torch.randn(50); p.grad=g.clone(); q.grad=g.clone(); o.step(); r.step()\n"
        "msgs=[str(x.message) for x in w if 'unavailable' in str(x.message)]\n"
        "assert len(msgs)==1 and 'ZEROINF_DISABLE_OPS' in msgs[0], msgs\n"
        "print((p-q).abs().max().item())\n"
    )
    env = dict(os.environ, ZEROINF_DISABLE_OPS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) <= TOL


def test_list_form_equals_single_calls_and_checks_all_first():
    sizes = [5, 16, 33]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    ps = [torch.randn(s) for s in sizes]
    gs = [torch.randn(s).to(torch.bfloat16) for s in sizes]
    ref = [(p.clone(), torch.zeros_like(p), torch.zeros_like(p)) for p in ps]
    outs = [None, torch.zeros(16, dtype=torch.float16), None]
    ref_outs = [None, torch.zeros(16, dtype=torch.float16), None]
    mine = [(p.clone(), torch.zeros_like(p), torch.zeros_like(p)) for p in ps]
    for i, ((p, m, v), g) in enumerate(zip(ref, gs)):
        zo.adam_step(p, g, m, v, step=i + 1, params_out=ref_outs[i], **kw)
    zo.adam_step_list([t[0] for t in mine], gs, [t[1] for t in mine], [t[2] for t in mine], steps=[1, 2, 3],
                      params_outs=outs, **kw)
    for a, b in zip(mine, ref):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(outs[1], ref_outs[1])
    before = [t[0].clone() for t in mine]
    bad_v = [mine[0][2], mine[1][2], torch.zeros(34)]
    with pytest.raises(ValueError, match=r"exp_avg_sq\[2\]"):
        zo.adam_step_list([t[0] for t in mine], gs, [t[1] for t in mine], bad_v, steps=[1, 2, 3], **kw)
    assert all(torch.equal(t[0], b) for t, b in zip(mine, before)), "nothing written before the check failed"


def test_limit_thread_parallelism_caps_the_calling_thread_only():
    """A background thread capped at one thread steps the same bits as the main thread on four;
    the main thread and threads started afterwards keep the process's count (torch.set_num_threads
    called from the background thread would have changed theirs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        n = 2**20 + 3
        init, grad = torch.randn(n), torch.randn(n)
        kw = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
        main = [init.clone(), torch.zeros(n), torch.zeros(n)]
        zo.adam_step(main[0], grad, main[1], main[2], **kw)
        seen, capped = {}, [init.clone(), torch.zeros(n), torch.zeros(n)]

        def work():
            seen["returned"] = zo.limit_thread_parallelism(1)
            seen["threads"] = torch.get_num_threads()
            zo.adam_step(capped[0], grad, capped[1], capped[2], **kw)
            seen["after_step"] = torch.get_num_threads()

        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert seen == {"returned": 1, "threads": 1, "after_step": 1}
        assert torch.get_num_threads() == 4
        later = threading.Thread(target=lambda: seen.update(later=torch.get_num_threads()))
        later.start()
        later.join()
        assert seen["later"] == 4
        for a, b in zip(main, capped):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        with pytest.raises(ValueError, match="n must be >= 1, got 0"):
            zo.limit_thread_parallelism(0)
        for bad in (2.5, True, "3"):
            with pytest.raises(TypeError, match="n must be an int"):
                zo.limit_thread_parallelism(bad)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task")
def test_a_capped_thread_starts_no_wider_team_for_matmuls_or_element_wise_ops():
    """A fresh thread's first parallel op starts its team's threads (OpenMP's for element-wise
    ops, MKL's for matmuls where torch has MKL): capped at one, it starts none, and a cap above
    the thread's count leaves the count as it was (helper-47 t01, t02)."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        a, b, big = torch.randn(512, 512), torch.randn(512, 512), torch.randn(1 << 22)
        seen = {}

        def started(fn):
            n0 = len(os.listdir("/proc/self/task"))
            fn()
            return len(os.listdir("/proc/self/task")) - n0

        def capped():
            seen["cap"] = zo.limit_thread_parallelism(1)
            seen["matmul"] = started(lambda: torch.mm(a, b))
            seen["add"] = started(lambda: big.add_(1.0))

        def uncapped():
            seen["above"] = zo.limit_thread_parallelism(64)
            seen["matmul_uncapped"] = started(lambda: torch.mm(a, b))

        for fn in (capped, uncapped):
            t = threading.Thread(target=fn)
            t.start()
            t.join()
        assert seen["above"] == 4 and seen["matmul_uncapped"] > 0, seen  # the count test can see teams start
        assert (seen["cap"], seen["matmul"], seen["add"]) == (1, 0, 0), seen
    finally:
        torch.set_num_threads(before)
