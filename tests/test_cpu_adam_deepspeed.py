"""DeepSpeedCPUAdam and the DeepSpeed op-builder entry points against plain PyTorch references
(DeepSpeed's own tests of them run from tests/deepspeed_ops/)."""
import pytest
import torch

from zeroinf.ops import OpUnavailableError, __compatible_ops__
from zeroinf.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zeroinf.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder, FusedAdamBuilder
from zeroinf.optim import adam_step_reference


def test_step_subgroup_matches_torch_adamw():
    base = torch.randn(300)
    p, ref = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
    opt = DeepSpeedCPUAdam([p], lr=1e-2, weight_decay=0.1)
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        g = torch.randn(300)
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step_subgroup(7)
        torch_opt.step()
    assert opt.state[7]["step"] == 3 and p not in opt.state
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(opt.state[7]["exp_avg"], torch_opt.state[ref]["exp_avg"], rtol=0, atol=1e-7)
    torch.testing.assert_close(opt.state[7]["exp_avg_sq"], torch_opt.state[ref]["exp_avg_sq"], rtol=0, atol=1e-7)


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("bias_correction", [True, False], ids=["bc", "nobc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rollback_subgroup_undoes_the_step(adamw_mode, bias_correction, dtype):
    p = torch.nn.Parameter(torch.randn(256).to(dtype))
    opt = DeepSpeedCPUAdam([p], lr=1e-2, bias_correction=bias_correction, weight_decay=0.05, adamw_mode=adamw_mode)
    for _ in range(2):
        p.grad = torch.randn(256).to(dtype)
        opt.step_subgroup(0)
    st = opt.state[0]
    before = {k: st[k].clone() for k in ("exp_avg", "exp_avg_sq")}
    master_before = (p.detach().float() if dtype == torch.float32 else st["master_param"]).clone()
    p_before = p.detach().clone()
    p.grad = torch.randn(256).to(dtype)
    opt.step_subgroup(0)
    assert not torch.equal(p.detach(), p_before)
    opt.rollback_subgroup(0)
    assert st["step"] == 2
    master = p.detach().float() if dtype == torch.float32 else st["master_param"]
    torch.testing.assert_close(master, master_before, rtol=0, atol=1e-6)
    for k, v in before.items():
        torch.testing.assert_close(st[k], v, rtol=1e-5, atol=1e-8)
    assert torch.equal(p.detach(), master.to(dtype))


def test_bf16_optimizer_states_round_every_step_like_deepspeed():
    base = torch.randn(1000).to(torch.bfloat16)
    p = torch.nn.Parameter(base.clone())
    opt = DeepSpeedCPUAdam([p], lr=1e-2, fp32_optimizer_states=False)
    master, m, v = base.float(), torch.zeros(1000), torch.zeros(1000)
    for step in range(1, 6):
        g = torch.randn(1000).to(torch.bfloat16)
        p.grad = g
        opt.step()
        adam_step_reference(master, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        m, v = m.bfloat16().float(), v.bfloat16().float()  # the moments are stored in bf16
    st = opt.state[p]
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
    torch.testing.assert_close(st["exp_avg"].float(), m, rtol=2 ** -7, atol=1e-9)
    torch.testing.assert_close(st["exp_avg_sq"].float(), v, rtol=2 ** -7, atol=1e-12)
    torch.testing.assert_close(p.detach().float(), master.bfloat16().float(), rtol=2 ** -7, atol=1e-6)
    opt.load_state_dict(opt.state_dict())  # stays in bf16 after a load
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16


def test_subgroup_errors_name_the_problem():
    a, b = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    opt = DeepSpeedCPUAdam([a, b])
    a.grad, b.grad = torch.randn(8), torch.randn(8)
    with pytest.raises(ValueError, match=r"step_subgroup\(0\): 2 parameters have gradients"):
        opt.step_subgroup(0)
    b.grad = None
    opt.step_subgroup(0)
    a.grad = None
    with pytest.raises(ValueError, match="needs the gradient the step used"):
        opt.rollback_subgroup(0)
    c = torch.nn.Parameter(torch.randn(9))
    c.grad = torch.randn(9)
    opt.param_groups[0]["params"] = [c]
    with pytest.raises(ValueError, match="sub-group 0 holds moments of 8 elements"):
        opt.step_subgroup(0)
    assert opt.state[0]["step"] == 1


def test_op_builder_entry_points():
    import zeroinf as deepspeed

    assert __compatible_ops__ == {"cpu_adam": True, "async_io": True, "fused_adam": False}
    assert deepspeed.ops.adam.DeepSpeedCPUAdam is DeepSpeedCPUAdam  # DeepSpeed's attribute path
    op = CPUAdamBuilder().load()
    op.create_adam(3, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, False)
    base = torch.randn(50)
    p, ref = base.clone(), torch.nn.Parameter(base.clone())
    m, v = torch.zeros(50), torch.zeros(50)
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    for step in (1, 2):
        g = torch.randn(50)
        ref.grad = g.clone()
        assert op.adam_update(3, step, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, p, g, m, v) == 0
        torch_opt.step()
    torch.testing.assert_close(p, ref.detach(), rtol=0, atol=1e-6)
    op.destroy_adam(3)
    with pytest.raises(KeyError, match="optimizer 3 was not created"):
        op.adam_update(3, 1, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, p, g, m, v)
    h = AsyncIOBuilder().load().aio_handle()
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism()) == (1 << 20, 128, False, False, 1)
    h.close()
    with pytest.raises(OpUnavailableError, match=r"torch.optim.AdamW\(fused=True\)"):
        FusedAdamBuilder().load()
    with pytest.raises(OpUnavailableError, match="FusedAdam"):
        FusedAdam([ref])
