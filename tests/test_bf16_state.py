"""bf16 optimizer state (``offload_optimizer.state_dtype: "bf16"``): the fused step against an fp32
PyTorch reference, stochastic rounding (unbiased, deterministic, equal on every ISA path and in
the PyTorch fallback), NVMe swap files and checksums, checkpoint resume, training quality."""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroinf
from zeroinf.config import ConfigError, parse_config
from zeroinf.estimate import Placement, estimate
from zeroinf.io import ChecksumMismatchError
from zeroinf.optim.functional import (adam_step, adam_step_reference, isa_info, round_bf16_stochastic,
                                      round_bf16_stochastic_reference)
from zeroinf.runtime.optimizer import SubGroupOptimizer, SubGroupSpec, state_bytes_per_element

ISAS = [i for i, why in isa_info()["unsupported"].items() if not why] or ["auto"]
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
BF16_STEP = 2.0 ** -7  # relative spacing of bf16 values (8 significant bits)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_step_matches_the_fp32_reference_within_bf16_rounding(monkeypatch, isa):
    """Five steps with bf16 moments against the same steps with fp32 moments in plain PyTorch ops:
    the parameters agree to float rounding after the first step (it reads the same moments) and
    to bf16 noise after five; the moments stay within the rounding of five steps of the fp32
    ones. The moments' bits equal the PyTorch fallback's (same random bits)."""
    monkeypatch.setenv("ZEROINF_ADAM_ISA", isa)
    g0 = torch.Generator().manual_seed(0)
    n = 10_007  # not a multiple of any vector width: the tail runs too
    p = torch.randn(n, generator=g0)
    m = (0.1 * torch.randn(n, generator=g0)).bfloat16()
    v = (0.01 * torch.rand(n, generator=g0)).bfloat16()
    p32, m32, v32 = p.clone(), m.float(), v.float()
    pr, mr, vr = p.clone(), m.clone(), v.clone()
    for step in range(1, 6):
        g = torch.randn(n, generator=g0)
        adam_step(p, g, m, v, step=step, sr_seed=11, **HYPER)
        adam_step_reference(pr, g, mr, vr, step=step, sr_seed=11, **HYPER)
        adam_step_reference(p32, g, m32, v32, step=step, **HYPER)
        assert torch.equal(_bits(m), _bits(mr)) and torch.equal(_bits(v), _bits(vr))
        torch.testing.assert_close(p, pr, rtol=0, atol=1e-6)
        if step == 1:
            torch.testing.assert_close(p, p32, rtol=0, atol=1e-6)
    assert m.dtype == v.dtype == torch.bfloat16
    # each step's rounding is off by less than one bf16 step of the value (2^-7 of it), and the
    # errors of earlier steps decay: after 5 steps less than 5 steps of the largest value for
    # exp_avg (it changes sign, so relative errors near 0 mean nothing), 5 steps relative for
    # the positive exp_avg_sq
    assert (m.float() - m32).abs().max().item() < 5 * BF16_STEP * m32.abs().max().item()
    torch.testing.assert_close(v.float(), v32, rtol=5 * BF16_STEP, atol=0.0)
    # each step moves a parameter by about lr; bf16 moments perturb that by about 1%
    assert (p - p32).abs().max().item() < 5 * 0.02 * HYPER["lr"]


@pytest.mark.parametrize("isa", ISAS)
def test_stochastic_rounding_is_unbiased_and_deterministic(monkeypatch, isa):
    """100k roundings of a value 0.3 of the way between two bf16 neighbours: each gives one of the
    two, the share rounded up is 0.3 and the mean the value (within 5 standard errors); the same
    (seed, step) gives the same bits, another step other bits, the fallback the same bits."""
    monkeypatch.setenv("ZEROINF_ADAM_ISA", isa)
    lo, hi = 1.5, 1.5 + 2 ** -7  # neighbouring bf16 values (8 significant bits)
    x = torch.full((100_000,), lo + 0.3 * (hi - lo))
    r = round_bf16_stochastic(x, sr_seed=7, step=3)
    assert r.dtype == torch.bfloat16
    vals = r.float()
    assert set(vals.unique().tolist()) == {lo, hi}
    up = (vals == hi).double().mean().item()
    se = (0.3 * 0.7 / x.numel()) ** 0.5
    assert abs(up - 0.3) < 5 * se
    assert abs(vals.double().mean().item() - x[0].item()) < 5 * se * (hi - lo)
    assert torch.equal(_bits(r), _bits(round_bf16_stochastic(x, sr_seed=7, step=3)))
    assert torch.equal(_bits(r), _bits(round_bf16_stochastic_reference(x, sr_seed=7, step=3)))
    assert not torch.equal(_bits(r), _bits(round_bf16_stochastic(x, sr_seed=7, step=4)))
    assert not torch.equal(_bits(r), _bits(round_bf16_stochastic(x, sr_seed=8, step=3)))
    # exact values stay, NaN becomes torch's bf16 NaN, infinities stay
    special = torch.tensor([0.0, -2.0, 1.5, float("inf"), -float("inf"), float("nan")])
    out = round_bf16_stochastic(special, sr_seed=1, step=1)
    assert out[:5].float().tolist() == special[:5].tolist() and torch.isnan(out[5])


def test_small_second_moment_updates_are_not_lost():
    """beta2 = 0.999 changes exp_avg_sq by 0.1% per step, under half a bf16 step: round to
    nearest would leave it where it starts. With stochastic rounding, 3000 steps of a constant
    gradient bring it, on average over the elements, to the fp32 value (1 - 0.999^t) g^2."""
    n, g = 2048, torch.full((2048,), 0.5)
    p, m, v = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    for step in range(1, 3001):
        adam_step(p, g, m, v, step=step, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, sr_seed=5)
    want = (1 - 0.999 ** 3000) * 0.25
    assert abs(v.float().mean().item() - want) < 0.005 * want
    v_rne = torch.zeros(n, dtype=torch.bfloat16)  # the same recurrence rounded to nearest stalls
    for _ in range(3000):
        v_rne = (v_rne.float() * 0.999 + 0.001 * 0.25).bfloat16()
    assert v_rne.float().mean().item() < 0.5 * want


def _nvme_optimizer(tmp_path, numels, **kw):
    specs = [SubGroupSpec(f"g0/s{i}", n) for i, n in enumerate(numels)]
    return SubGroupOptimizer(specs, device="nvme", swap_dir=str(tmp_path), buffer_count=3, pipeline_read=True,
                             pipeline_write=True, state_dtype=torch.bfloat16, **kw)


def test_nvme_swap_round_trip_holds_the_bytes_and_halves_the_moments(tmp_path):
    """load_state, then state() reads back the same bytes; the swap file is [fp32 master | bf16
    exp_avg | bf16 exp_avg_sq], 8 bytes per element, and a step moves 8 bytes per element each way."""
    numels = [1000, 777]
    opt = _nvme_optimizer(tmp_path, numels)
    try:
        g0 = torch.Generator().manual_seed(2)
        want = []
        for i, n in enumerate(numels):
            master = torch.randn(n, generator=g0)
            m, v = torch.randn(n, generator=g0).bfloat16(), torch.rand(n, generator=g0).bfloat16()
            opt.load_state(i, master, m, v)
            want.append((master, m, v))
        for i, (master, m, v) in enumerate(want):
            with opt.state(i) as (rm, rexp, rsq):
                assert rexp.dtype == rsq.dtype == torch.bfloat16 and rm.dtype == torch.float32
                assert torch.equal(rm, master)
                assert torch.equal(_bits(rexp), _bits(m)) and torch.equal(_bits(rsq), _bits(v))
            path = opt._swapper.path_for(opt._file_key(opt.specs[i]))
            raw = path.read_bytes()
            assert len(raw) == 8 * numels[i]
            expect = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in (master, m, v))
            assert raw == expect
        grads = [torch.randn(n, generator=g0) for n in numels]
        outs = [torch.empty(n) for n in numels]
        opt.step(step=1, hyper=[dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)],
                 grad=lambda i: grads[i], out=lambda i: outs[i])
        assert opt.stats.bytes_read == opt.stats.bytes_written == 8 * sum(numels)
        # the same step in plain PyTorch with the same random bits
        for i, (master, m, v) in enumerate(want):
            adam_step_reference(master, grads[i], m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                weight_decay=0.0, sr_seed=opt._seeds[i])
            torch.testing.assert_close(outs[i], master, rtol=0, atol=1e-6)
            with opt.state(i) as (_, rexp, rsq):
                assert torch.equal(_bits(rexp), _bits(m)) and torch.equal(_bits(rsq), _bits(v))
    finally:
        opt.close()


def test_checksum_detects_a_corrupted_bf16_swap_chunk(tmp_path):
    """One flipped bit in the exp_avg_sq half of a bf16 swap file: reading it raises the checksum
    error naming the file."""
    n = 300_000  # 2.4 MB: three checksum chunks
    opt = _nvme_optimizer(tmp_path, [n])
    try:
        opt.load_state(0, torch.randn(n), torch.randn(n).bfloat16(), torch.rand(n).bfloat16())
        path = opt._swapper.path_for(opt._file_key(opt.specs[0]))
        at = 4 * n + 2 * n + 12345  # inside exp_avg_sq
        with open(path, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x10]))
        with pytest.raises(ChecksumMismatchError) as err:
            with opt.state(0):
                pass
        assert err.value.filename == str(path)
    finally:
        opt.close()


def _engine(nvme: str, state_dtype: str, device: str = "nvme", seed: int = 1):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 2, "sub_group_size": 500, "offload_optimizer": {
               "device": device, "nvme_path": nvme, "pipeline_read": True, "pipeline_write": True,
               "state_dtype": state_dtype}}}
    engine, *_ = zeroinf.initialize(model, config=cfg)
    return model, engine


def _data(steps: int):
    g = torch.Generator().manual_seed(3)
    X = torch.randn(steps, 8, 16, generator=g)
    W = torch.randn(16, 4, generator=g)
    return X, torch.tanh(X @ W)


def _train(engine, X, Y, a, b):
    losses = []
    for i in range(a, b):
        loss = F.mse_loss(engine(X[i]), Y[i])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_checkpoint_resume_is_bit_exact(tmp_path):
    """8 steps straight == 4 steps, save, a fresh engine loads, 4 more: the same weights and the
    same bf16 moments, bit for bit (the rounding depends on the step, not on the run)."""
    X, Y = _data(8)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    model, engine = _engine(str(tmp_path / "a"), "bf16")
    _train(engine, X, Y, 0, 8)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    full_state = [tuple(t.clone() for t in _state(engine, i)) for i in range(len(engine.sub_optimizer.specs))]
    assert len(full_state) > 1 and full_state[0][1].dtype == torch.bfloat16
    engine.close()

    model, engine = _engine(str(tmp_path / "b"), "bf16")
    _train(engine, X, Y, 0, 4)
    engine.save_checkpoint(str(tmp_path / "ck"), "step4")
    engine.close()
    model, engine = _engine(str(tmp_path / "c"), "bf16", seed=99)  # other initial weights: the load sets them
    engine.load_checkpoint(str(tmp_path / "ck"), "step4")
    _train(engine, X, Y, 4, 8)
    for k, v in model.state_dict().items():
        assert torch.equal(v, full[k]), k
    for i, want in enumerate(full_state):
        for got, w in zip(_state(engine, i), want):
            assert got.dtype == w.dtype and torch.equal(got.view(torch.uint8), w.view(torch.uint8))
    engine.close()


def _state(engine, i):
    with engine.sub_optimizer.state(i) as (master, m, v):
        return master.clone(), m.clone(), v.clone()


def test_training_quality_matches_fp32_state(tmp_path):
    """100 steps of a small regression with the state in host memory: bf16 moments reach a final
    loss (mean of the last 20 steps) within 1% of fp32 moments from the same start; both learn
    (the loss falls below a third of the first steps')."""
    X, Y = _data(100)
    finals = {}
    for dtype in ("fp32", "bf16"):
        _, engine = _engine(str(tmp_path), dtype, device="cpu")
        losses = _train(engine, X, Y, 0, 100)
        engine.close()
        finals[dtype] = sum(losses[-20:]) / 20
        assert finals[dtype] < sum(losses[:5]) / 5 / 3
    assert abs(finals["bf16"] - finals["fp32"]) <= 0.01 * finals["fp32"], finals


def test_config_key_and_memory_model():
    """The key parses to the dataclass, a bad value is one error naming the key; the estimator
    counts 4 + 2 + 2 bytes per element of offloaded state with bf16 moments."""
    base = {"train_micro_batch_size_per_gpu": 1}
    cfg = parse_config({**base, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                                        "state_dtype": "bf16"}}})
    assert cfg.zero_optimization.offload_optimizer.state_dtype == "bf16"
    assert parse_config(base).zero_optimization.offload_optimizer.state_dtype == "fp32"
    with pytest.raises(ConfigError, match=r"zero_optimization\.offload_optimizer\.state_dtype"):
        parse_config({**base, "zero_optimization": {"stage": 2, "offload_optimizer": {"state_dtype": "fp16"}}})
    assert state_bytes_per_element(torch.bfloat16) == 8 and state_bytes_per_element(torch.float32) == 12
    assert state_bytes_per_element(torch.bfloat16, master=False) == 4
    pl = Placement(2, "none", "nvme")
    e32 = estimate(10**9, pl, precision="bf16")
    e16 = estimate(10**9, pl, precision="bf16", state_dtype="bf16")
    opt = lambda e: next(t.bytes for t in e.terms if t.name.startswith("optimizer state"))
    assert opt(e32) == 12 * 10**9 and opt(e16) == 8 * 10**9


def test_stage3_infinity_with_bf16_moments_follows_plain_adamw(tmp_path):
    """Stage 3, parameters and optimizer on NVMe, fp32: the partitions are the masters, so the
    optimizer's swap files hold only the bf16 moments (4 bytes per element; a step moves that
    each way), and 6 steps stay within bf16 noise of plain torch.optim.AdamW."""
    import copy

    from stage3_models import TinyLM, batch, loss_fn
    from stage3_engine_helpers import _config, _reference

    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    cfg = _config("nvme", "nvme", tmp_path)
    cfg["zero_optimization"]["offload_optimizer"]["state_dtype"] = "bf16"
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    try:
        opt = engine.sub_optimizer
        assert opt.master_io is not None and opt._elem_bytes == 4
        numel = sum(s.numel for s in opt.specs)
        files = [opt._swapper.path_for(opt._file_key(s)) for s in opt.specs]
        assert sum(os.path.getsize(f) for f in files) == 4 * numel
        losses = []
        for step in range(1, 7):
            x, y = batch(step)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.synchronize()  # the overlapped step of the last iteration
        assert opt.stats.bytes_read == opt.stats.bytes_written == 4 * numel
    finally:
        engine.close()
    want = _reference(ref, 6)
    assert max(abs(a - b) for a, b in zip(losses, want)) < 2e-3 * max(want), (losses, want)


def test_planner_and_commands_take_the_state_dtype(tmp_path, capsys):
    """make_config writes the key (and parse_config takes it back); the NVMe step-time bound moves
    8 bytes per parameter each way; zeroinf estimate --state-dtype and plan --state-dtype use it."""
    import json

    from zeroinf import cli
    from zeroinf.placement import make_config, step_time_bounds

    pl = Placement(2, "none", "nvme")
    cfg = make_config(pl, state_dtype="bf16")
    assert cfg["zero_optimization"]["offload_optimizer"]["state_dtype"] == "bf16"
    assert parse_config(cfg).zero_optimization.offload_optimizer.state_dtype == "bf16"
    assert "state_dtype" not in make_config(pl)["zero_optimization"]["offload_optimizer"]
    est = estimate(10**9, pl, state_dtype="bf16")
    secs, _ = step_time_bounds(est, nvme_read_gbps=1.0, nvme_write_gbps=1.0, state_dtype="bf16")["nvme"]
    assert secs == pytest.approx(2 * 8.0)  # 8 GB read + 8 GB written at 1 GB/s
    assert cli.main(["estimate", "--params", "1B", "--stage", "2", "--state-dtype", "bf16", "--json"]) == 0
    rows = {r["offload_optimizer"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["nvme"]["nvme_bytes"] == 8 * 10**9 and rows["none"]["per_device_bytes"] == 16 * 10**9
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--params", "1B", "--gpu-mem", "4GB", "--cpu-mem", "24GB", "--nvme", "100GB",
                     "--state-dtype", "bf16", "--out", str(out)]) == 0
    written = json.loads(out.read_text())["zero_optimization"]
    assert written["offload_optimizer"]["state_dtype"] == "bf16", written
