"""SubGroupOptimizer: NVMe state with every pipelining choice gives the bits of CPU-resident state,
which follow torch.optim.AdamW; reads of the state, subsets of sub-groups, and its errors."""
import pytest
import torch

from zeroinf.runtime.optimizer import SubGroupOptimizer, SubGroupSpec

SIZES = [1, 17, 4097, 33, 1000]
HYPER = [{"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
         {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.0}]


def specs():
    return [SubGroupSpec(f"g{i % 2}/s{i}", n, i % 2) for i, n in enumerate(SIZES)]


def run(opt, steps=3, out_dtype=torch.float32, indices=None):
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=g) for n in SIZES]
    for i, t in enumerate(init):
        opt.init_master(i, t)
    outs = [torch.zeros(n, dtype=out_dtype) for n in SIZES]
    for t in range(1, steps + 1):
        grads = [torch.randn(n, generator=g) for n in SIZES]
        opt.step(step=t, hyper=HYPER, grad=lambda i: grads[i], out=lambda i: outs[i], indices=indices)
    return init, outs


@pytest.mark.parametrize("pr,pw", [(False, False), (True, False), (False, True), (True, True)])
def test_nvme_state_equals_cpu_state_bitwise(pr, pw, tmp_path):
    _, want = run(SubGroupOptimizer(specs(), device="cpu"))
    opt = SubGroupOptimizer(specs(), device="nvme", swap_dir=str(tmp_path), buffer_count=1 + pr + pw,
                            pipeline_read=pr, pipeline_write=pw)
    _, got = run(opt)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert opt.stats.bytes_read == opt.stats.bytes_written == 12 * sum(SIZES)
    with opt.state(2) as (master, m, v):
        assert torch.equal(master, got[2]) and m.abs().sum() > 0 and (v > 0).all()
    opt.close()


def test_cpu_state_follows_torch_adamw_and_bf16_out_is_the_rounded_master():
    opt = SubGroupOptimizer(specs(), device="cpu")
    init, outs = run(opt, out_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    [torch.randn(n, generator=g) for n in SIZES]  # the same draws as run()
    params = [torch.nn.Parameter(t.clone()) for t in init]
    ref = torch.optim.AdamW([{"params": [p], **HYPER[i % 2]} for i, p in enumerate(params)], foreach=False)
    for _ in range(3):
        for p, n in zip(params, SIZES):
            p.grad = torch.randn(n, generator=g)
        ref.step()
    for i, p in enumerate(params):
        with opt.state(i) as (master, m, v):
            assert torch.allclose(master, p.detach(), atol=1e-6, rtol=0)
            assert torch.allclose(v, ref.state[p]["exp_avg_sq"], atol=1e-7, rtol=1e-5)
            assert torch.equal(outs[i], master.to(torch.bfloat16))


def test_subset_of_sub_groups_and_errors(tmp_path):
    opt = SubGroupOptimizer(specs(), device="nvme", swap_dir=str(tmp_path), pipeline_read=True, buffer_count=2)
    init, outs = run(opt, steps=1, indices=[4, 1])
    assert torch.equal(outs[0], torch.zeros(1)) and not torch.equal(outs[4], torch.zeros(1000))
    with opt.state(0) as (master, _, _):
        assert torch.equal(master, init[0])  # not stepped
    with pytest.raises(ValueError, match="g0/s2.*numel 4097"):
        opt.init_master(2, torch.zeros(5))
    with pytest.raises(ValueError, match="gradient of sub-group 'g1/s1'"):
        opt.step(step=2, hyper=HYPER, grad=lambda i: torch.zeros(3), out=lambda i: None, indices=[1])
    assert len(opt._free) == len(opt._buffers)  # a failed step leaves every buffer free
    with pytest.raises(ValueError, match="duplicate"):
        SubGroupOptimizer([SubGroupSpec("a", 1), SubGroupSpec("a", 2)])
    with pytest.raises(ValueError, match="buffer_count 1 is too small"):
        SubGroupOptimizer(specs(), device="nvme", swap_dir=str(tmp_path), buffer_count=1, pipeline_write=True)
    fresh = SubGroupOptimizer(specs(), device="cpu")
    with pytest.raises(RuntimeError, match="never initialised"):
        fresh.step(step=1, hyper=HYPER, grad=lambda i: torch.zeros(SIZES[i]), out=lambda i: None)
    opt.close()


@pytest.mark.parametrize("block", [True, False])
@pytest.mark.parametrize("sizes", [[5000], [5000, 17]])
def test_prefetch_and_in_flight_tail_write_keep_the_bits(sizes, block, tmp_path):
    """The step leaves its last swap-out in flight and prefetch() reads ahead, also of the same
    sub-group (one sub-group): the results stay those of CPU-resident state. ``block=False``
    (the stage-3 optimizer in backward's reads in the forward) does not wait for that swap-out:
    it reads only the sub-groups before the one being written, into the buffers free."""
    sp = [SubGroupSpec(f"s{i}", n) for i, n in enumerate(sizes)]
    ref = SubGroupOptimizer(sp, device="cpu")
    opt = SubGroupOptimizer(sp, device="nvme", swap_dir=str(tmp_path), buffer_count=3, pipeline_read=True,
                            pipeline_write=True)
    g = torch.Generator().manual_seed(1)
    for o in (ref, opt):
        for i, n in enumerate(sizes):
            o.init_master(i, torch.linspace(-1, 1, n))
    outs = {id(o): [torch.zeros(n) for n in sizes] for o in (ref, opt)}
    for t in range(1, 5):
        grads = [torch.randn(n, generator=g) for n in sizes]
        for o in (ref, opt):
            if o is opt and t > 1:
                tail = opt._tail
                opt.prefetch(block=block)
                if not block:  # the file being written is not read; its buffer stays taken
                    assert opt._tail == tail == len(sizes) - 1 and opt._ahead == list(range(len(sizes) - 1))
            o.step(step=t, hyper=HYPER, grad=lambda i: grads[i], out=lambda i, o=o: outs[id(o)][i])
        assert all(torch.equal(a, b) for a, b in zip(outs[id(ref)], outs[id(opt)])), t
    opt.prefetch()
    with opt.state(len(sizes) - 1) as (master, _, _):  # completes the tail write and the prefetch
        assert torch.equal(master, outs[id(ref)][-1])
    opt.close()


class _DictMaster:
    """A MasterIO over plain tensors the caller owns (as stage 3's partitions), counting calls."""

    def __init__(self, n):
        self.t = [torch.zeros(k) for k in n]
        self.reads = self.writes = 0

    def read(self, i):
        self.reads += 1
        return self.t[i].clone()

    def write(self, i, values):
        self.writes += 1
        self.t[i].copy_(values)


@pytest.mark.parametrize("pr,pw", [(False, False), (True, True)])
def test_master_io_swaps_only_the_moments_and_keeps_the_bits(pr, pw, tmp_path):
    """With master_io the caller's fp32 tensors are the masters: out(i) is stepped in place, the
    swap files hold 8 bytes per element, and the numbers are CPU-resident state's bit for bit."""
    _, want = run(SubGroupOptimizer(specs(), device="cpu"))
    io = _DictMaster(SIZES)
    opt = SubGroupOptimizer(specs(), device="nvme", swap_dir=str(tmp_path), buffer_count=1 + pr + pw,
                            pipeline_read=pr, pipeline_write=pw, master_io=io)
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate(SIZES):
        opt.init_master(i, torch.randn(n, generator=g))  # written through master_io
    assert io.writes == len(SIZES)
    for t in range(1, 4):
        grads = [torch.randn(n, generator=g) for n in SIZES]
        opt.step(step=t, hyper=HYPER, grad=lambda i: grads[i], out=lambda i: io.t[i])
    assert all(torch.equal(a, b) for a, b in zip(want, io.t))
    assert opt.stats.bytes_read == opt.stats.bytes_written == 8 * sum(SIZES)
    assert opt._pool.buffer_size == 8 * max(SIZES)  # a swap buffer holds the moments only
    files = sorted(tmp_path.rglob("*adam_moments*.swp"))
    assert len(files) == len(SIZES) and sum(f.stat().st_size for f in files) == 8 * sum(SIZES)
    assert not list(tmp_path.rglob("*adam_state*"))
    with opt.state(2) as (master, m, v):
        assert torch.equal(master, want[2]) and io.reads == 1 and m.abs().sum() > 0 and (v > 0).all()
        m2, v2 = m.clone(), v.clone()
    # load_state writes the master through master_io and the moments to the file; None keeps the master
    opt.load_state(2, torch.full((SIZES[2],), 0.25), m2 * 2, v2)
    assert torch.equal(io.t[2], torch.full((SIZES[2],), 0.25))
    opt.load_state(2, None, m2, v2)
    assert torch.equal(io.t[2], torch.full((SIZES[2],), 0.25))
    with opt.state(2) as (master, m, v):
        assert torch.equal(m, m2) and torch.equal(v, v2)
    opt.init_master(0, None)  # moments only: the master stays the caller's
    assert torch.equal(io.t[0], want[0])
    opt.close()


def test_master_io_errors(tmp_path):
    io = _DictMaster(SIZES)
    with pytest.raises(ValueError, match="master_io needs device 'nvme'"):
        SubGroupOptimizer(specs(), device="cpu", master_io=io)
    with pytest.raises(ValueError, match="only an optimizer with master_io"):
        SubGroupOptimizer(specs(), device="cpu").init_master(0, None)
    opt = SubGroupOptimizer(specs(), device="nvme", swap_dir=str(tmp_path), buffer_count=2, master_io=io)
    for i in range(len(SIZES)):
        opt.init_master(i, None)
    for bad in (lambda i: None, lambda i: torch.zeros(SIZES[i], dtype=torch.bfloat16),
                lambda i: torch.zeros(2 * SIZES[i])[::2]):
        with pytest.raises(ValueError, match=r"out\(1\) must be the fp32 master of sub-group 'g1/s1'"):
            opt.step(step=1, hyper=HYPER, grad=lambda i: torch.ones(SIZES[i]), out=bad, indices=[1])
        assert len(opt._free) == len(opt._buffers)
    opt.close()
