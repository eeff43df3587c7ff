"""zeroinf.estimate: model-state formulas, the source article's examples, parameter counting, CLI.

References are independent of the code under test: byte counts worked out by hand from the ZeRO
paper's rules, the article's own inputs, published parameter counts, and a closed-form Llama count.
"""
import dataclasses
import json
from pathlib import Path

import pytest

from zeroinf import cli
from zeroinf.config import parse_config
from zeroinf.estimate import (GB, GiB, PLACEMENTS, Placement, SwapBuffers, activation_bytes, count_params,
                              estimate, model_info, parse_bytes, parse_count, placement_from_config,
                              swap_buffers_from_config)
from zeroinf.working_set import GatherLimits, working_set

# --- formulas on a small exact case --------------------------------------------------------------
# P = 1000, N = 4 (2 ranks per node), bf16 + Adam: Ψp = Ψg = 2, K = 12, ceil(P/N) = 250.
# Swap settings chosen so every term is visible, with buffers rounded up to 4096-byte pages
# (zeroinf.io.pinned_pool_bytes): optimizer buffers in flight = min(buffer_count 3, 1 + read + write
# = 3, sub-groups ceil(part / 200)) of 12 B x 200 -> 4096 each: 3 x 4096 at stage 0 (5 sub-groups),
# 2 x 4096 at stages 1 and 2 (part 250: 2 sub-groups), 3 x 4096 at stage 3 (sub-groups are cut per
# unit, and no units are given: at least buffer_count, an upper bound); param buffers
# 3 x (2 B x 50 -> 4096) = 12288; max_in_cpu cache 2 B x min(10, 250) = 20.
SMALL_SWAP = SwapBuffers(param_buffer_count=3, param_buffer_size=50, param_max_in_cpu=10,
                         optimizer_buffer_count=3, optimizer_pipeline_read=True, optimizer_pipeline_write=True,
                         sub_group_size=200)
# (stage, offload_param, offload_optimizer): (device bytes, host bytes per rank, NVMe bytes per rank)
SMALL_EXPECTED = {
    (0, "none", "none"): (2000 + 2000 + 12000, 0, 0),
    (0, "none", "cpu"): (2000 + 2000, 12000 + 4000, 0),
    (0, "none", "nvme"): (2000 + 2000, 4000 + 12288, 12000),
    (1, "none", "none"): (2000 + 2000 + 3000, 0, 0),
    (1, "none", "cpu"): (2000 + 2000, 3000 + 1000, 0),
    (1, "none", "nvme"): (2000 + 2000, 1000 + 8192, 3000),
    (2, "none", "none"): (2000 + 500 + 3000, 0, 0),
    (2, "none", "cpu"): (2000, 3000 + 1000, 0),
    (2, "none", "nvme"): (2000, 1000 + 8192, 3000),
    (3, "none", "none"): (500 + 500 + 3000, 0, 0),
    (3, "none", "cpu"): (500, 3000 + 1000, 0),
    (3, "none", "nvme"): (500, 1000 + 12288, 3000),
    (3, "cpu", "none"): (500 + 3000, 500, 0),
    (3, "cpu", "cpu"): (0, 500 + 3000 + 1000, 0),
    (3, "cpu", "nvme"): (0, 500 + 1000 + 12288, 3000),
    (3, "nvme", "none"): (500 + 3000, 12288 + 20, 500),
    (3, "nvme", "cpu"): (0, 3000 + 1000 + 12288 + 20, 500),
    # ZeRO-Infinity: the fp32 gradient partition (1000) is swapped to NVMe, not pinned on the host,
    # and so is one micro-batch's bf16 partition (500)
    (3, "nvme", "nvme"): (0, 12288 + 12288 + 20, 3000 + 500 + 1000 + 500),
}


def test_every_placement_is_covered():
    assert {(p.stage, p.offload_param, p.offload_optimizer) for p in PLACEMENTS} == set(SMALL_EXPECTED)
    assert len(PLACEMENTS) == 18


@pytest.mark.parametrize("key", sorted(SMALL_EXPECTED), ids=lambda k: f"s{k[0]}-p{k[1]}-o{k[2]}")
def test_small_exact_case(key):
    dev, host, nvme = SMALL_EXPECTED[key]
    e = estimate(1000, Placement(*key), world_size=4, gpus_per_node=2, precision="bf16", optimizer="adam",
                 swap=SMALL_SWAP)
    assert (e.per_device_bytes, e.per_host_bytes, e.nvme_bytes) == (dev, 2 * host, 2 * nvme)
    assert all(t.formula for t in e.terms)


def test_stage3_swap_buffers_from_the_units():
    """Stage 3 cuts the optimizer's sub-groups per unit partition and sizes every swap buffer by
    the largest: units of 1,001, 3,000 and 10 elements on N = 4 ranks have partitions of 251, 750
    and 3; sub_group_size 500 cuts them into 1 + 2 + 1 = 4 sub-groups of at most 500 elements.
    bf16 + Adam (K = 12), pipeline_read: min(buffer_count 8, 4 sub-groups) buffers of 12 B x 500 ->
    8192 bytes; parameter buffers 3 x (2 B x min(buffer_size 1e8, 750) -> 4096)."""
    swap = SwapBuffers(param_buffer_count=3, optimizer_buffer_count=8, optimizer_pipeline_read=True, sub_group_size=500)
    e = estimate(4011, Placement(3, "nvme", "nvme"), world_size=4, swap=swap, unit_sizes=(1001, 3000, 10))
    terms = {t.name: t for t in e.terms}
    assert terms["optimizer swap buffers"].bytes == 4 * 8192
    assert "sub-groups 4" in terms["optimizer swap buffers"].formula
    assert terms["parameter swap buffers"].bytes == 3 * 4096
    # a buffer_count of 1 is raised to the 2 that reading one unit ahead needs, without prefetch not
    for prefetch, count in ((True, 2), (False, 1)):
        one = dataclasses.replace(swap, param_buffer_count=1, param_prefetch=prefetch)
        e = estimate(4011, Placement(3, "nvme", "nvme"), world_size=4, swap=one, unit_sizes=(1001, 3000, 10))
        assert next(t for t in e.terms if t.name == "parameter swap buffers").bytes == count * 4096


@pytest.mark.parametrize("params,n", [(1, 1), (1000, 4), (1001, 4), (7_000_000_007, 3), (65_000_000_000, 128)])
def test_zero_paper_formulas(params, n):
    s = -(-params // n)  # equal, padded partitions
    got = [estimate(params, Placement(st), world_size=n, precision="fp16").per_device_bytes for st in range(4)]
    assert got == [16 * params, 4 * params + 12 * s, 2 * params + 14 * s, 16 * s]


def test_precision_and_optimizer_bytes():
    p = 1000
    # fp32: params are the master weights; Adam keeps m and v (8 B); grads 4 B.
    assert estimate(p, Placement(0), precision="fp32").per_device_bytes == (4 + 4 + 8) * p
    # ... but an offloaded optimizer keeps its own fp32 master: K = 12 on the host.
    e = estimate(p, Placement(2, "none", "cpu"), precision="fp32")
    assert (e.per_device_bytes, e.per_host_bytes) == (4 * p, 12 * p + 4 * p)
    assert estimate(p, Placement(0), optimizer="sgd-momentum").per_device_bytes == (2 + 2 + 4 + 4) * p
    assert estimate(p, Placement(0), optimizer="adagrad").per_device_bytes == (2 + 2 + 4 + 4) * p
    assert estimate(p, Placement(0), optimizer="sgd").per_device_bytes == (2 + 2 + 4) * p


def test_stage3_gathered_unit_and_activations_are_device_terms():
    e0 = estimate(1000, Placement(3, "cpu", "cpu"), world_size=4)
    e1 = estimate(1000, Placement(3, "cpu", "cpu"), world_size=4, live_params=300, activations=77)
    assert e1.per_device_bytes - e0.per_device_bytes == (2 + 2) * 300 + 77
    assert e1.per_host_bytes == e0.per_host_bytes
    # no gathering below stage 3: the whole model is resident anyway
    assert estimate(1000, Placement(2), live_params=300).per_device_bytes == estimate(1000, Placement(2)).per_device_bytes


@pytest.mark.parametrize("bad", [dict(world_size=0), dict(world_size=4, gpus_per_node=3), dict(precision="fp8"),
                                 dict(optimizer="lion")])
def test_bad_arguments_name_the_key(bad):
    key = next(iter(bad)) if "gpus_per_node" not in bad else "gpus_per_node"
    with pytest.raises(ValueError, match=key):
        estimate(1000, Placement(0), **bad)


def test_param_offload_needs_stage3():
    with pytest.raises(ValueError, match="offload_param.device"):
        Placement(2, "cpu", "none")


# --- the source article (shared/seed): LLaMA-65B on 128 GPUs, 70B on 8 GPUs ----------------------

def test_article_llama65b_table():
    rows = {st: estimate(65 * 10**9, Placement(st), world_size=128, precision="fp16").per_device_bytes / GB
            for st in range(4)}
    assert rows[0] == 1040.0                       # article: 1040 GB
    assert rows[1] == pytest.approx(266.1, abs=0.05)   # article prints 260 GB: drops the 12P/N term
    assert rows[2] == pytest.approx(137.1, abs=0.05)   # article prints 195 GB: follows from no formula
    assert rows[3] == pytest.approx(8.1, abs=0.05)     # article: 8.1 GB
    assert abs(rows[1] - 260) > 5 and abs(rows[2] - 195) > 50


@pytest.mark.parametrize("shards,params_gb,optim_gb", [(8, 17.5, 105.0), (16, 8.75, 52.5)])
def test_article_70b_zero3_shards(shards, params_gb, optim_gb):
    e = estimate(70 * 10**9, Placement(3), world_size=shards, precision="fp16")
    terms = {t.name: t.bytes for t in e.terms}
    assert terms["fp16 parameters"] / GB == params_gb   # article: 70B x 2 / 8 / 2 = 8.75 GB
    assert terms["fp16 gradients"] / GB == params_gb
    assert terms["optimizer state (fp32)"] / GB == optim_gb   # article: 70B x 12 / 8 / 2 = 52.5 GB


# --- counting parameters on the meta device ------------------------------------------------------

def llama_closed_form(v, h, i, layers, heads, kv_heads, tied):
    """Parameters of a Llama decoder (no biases), derived from the architecture by hand."""
    head_dim = h // heads
    attn = h * h + 2 * h * kv_heads * head_dim + h * h          # q, k, v, o
    mlp = 3 * h * i                                             # gate, up, down
    per_layer = attn + mlp + 2 * h                              # two RMSNorms
    return v * h + layers * per_layer + h + (0 if tied else v * h)


# (tied, kv_heads, vocab, largest unit, live params without prefetch or reuse: persistent, root and
# two neighbouring blocks) with persistence threshold 1000: the norms
# (64 elements each, 3 x 2 + 1 of them = 448) are persistent; a block's other weights are
# q, o 4096 each, k, v 64 x kv_heads x 16 each, gate/up/down 64 x 176 each; the root unit holds the
# embedding and the untied lm_head (V x 64 each).
UNIT_CASES = [(False, 4, 1000, 128_000, 448 + 128_000 + 2 * 50_176),
              (True, 4, 1000, 64_000, 448 + 64_000 + 2 * 50_176),
              (False, 2, 100, 46_080, 448 + 12_800 + 2 * 46_080)]


@pytest.mark.parametrize("tied,kv_heads,vocab,largest,live", UNIT_CASES)
def test_llama_config_count_equals_closed_form(tmp_path, tied, kv_heads, vocab, largest, live):
    cfg = dict(model_type="llama", vocab_size=vocab, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    want = llama_closed_form(vocab, 64, 176, 3, 4, kv_heads, tied)
    assert count_params(cfg) == want
    info = model_info(str(path), persistence_threshold=1000)
    assert info.params == want
    assert (info.hidden, info.layers, info.heads, info.vocab) == (64, 3, 4, vocab)
    # without prefetch or reuse a rank gathers the persistent and root units and two blocks (in the
    # backward a block is held until its gradients are reduced, while the one before it begins)
    alone = model_info(str(path), persistence_threshold=1000,
                       limits=GatherLimits(prefetch_bucket_size=0, max_reuse_distance=0))
    assert (alone.largest_unit, alone.live_params) == (largest, live)
    # with the default bucket (5e7 elements) the other blocks are gathered ahead, and within the
    # default reuse distance (1e9) kept for the backward: the whole model is the working set
    assert (info.largest_unit, info.live_params) == (largest, want)
    # with the default threshold (1e5) every weight of this small model is persistent: one unit
    assert model_info(cfg).largest_unit == model_info(cfg).live_params == want


@pytest.mark.parametrize("limits,gathered", [
    # blocks 10, 30, 20, 30 (module order); persistent 5, root 7
    (GatherLimits(prefetch_bucket_size=0, max_reuse_distance=0), 30 + 20),     # two neighbouring blocks in use
    (GatherLimits(prefetch_bucket_size=30, max_reuse_distance=0), 30 + 20 + 30),  # and the third within the bucket
    (GatherLimits(prefetch_bucket_size=20, max_reuse_distance=0), 10 + 30 + 20),  # a 20-block fits a bucket of 20
    (GatherLimits(prefetch_bucket_size=50, max_reuse_distance=0), 90),          # blocks 0, 1 in use, 2 and 3 ahead
    (GatherLimits(prefetch_bucket_size=0, max_reuse_distance=60), 30 + 20),   # 2 x 30 after block 2: the last two kept
    (GatherLimits(prefetch_bucket_size=0, max_reuse_distance=100), 30 + 20 + 30),  # 2 x 50 after block 1: three kept
    (GatherLimits(prefetch_bucket_size=0, max_reuse_distance=10**9), 90),      # every block kept at the turn
    (GatherLimits(prefetch_bucket_size=10**9, max_live_parameters=40), 40),   # capped by max_live (root inside it)
])
def test_working_set_counts_prefetched_and_kept_blocks(limits, gathered):
    elements, formula = working_set(5, 7, (10, 30, 20, 30), limits)
    want = 5 + min(limits.max_live_parameters, 7 + gathered) if limits.max_live_parameters >= 37 else 5 + 37
    assert elements == want and formula.endswith(f"= {want:,}")


def test_working_set_never_below_root_and_largest_block():
    # a max_live below root + largest (the engine raises it to that sum) does not shrink the estimate
    assert working_set(0, 7, (30,), GatherLimits(max_live_parameters=1))[0] == 37


def test_stage3_units_agree_with_the_engine():
    torch = pytest.importorskip("torch")
    units_mod = pytest.importorskip("zeroinf.runtime.stage3.units")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zeroinf.estimate import stage3_unit_sizes, stage3_units

    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    units = units_mod.build_units(model, units_mod.find_unit_modules(model), 1000, world_size=1)
    sizes = {u.name: sum(g.numel for g in u.groups) for u in units}
    blocks = [v for k, v in sizes.items() if k not in ("<persistent>", "<root>")]
    assert stage3_units(model, 1000, GatherLimits(prefetch_bucket_size=0, max_reuse_distance=0)) == (
        max(sizes.values()), sizes["<persistent>"] + sizes["<root>"] + max(a + b for a, b in zip(blocks, blocks[1:])))
    assert stage3_units(model, 1000) == (max(sizes.values()), sum(sizes.values()))
    assert stage3_unit_sizes(model, 1000) == (sizes["<persistent>"], sizes["<root>"], tuple(blocks))


def test_presets_match_published_counts():
    assert count_params("llama-7b") == 6_738_415_616       # LLaMA-7B (Touvron et al. 2023)
    assert count_params("gpt2") == 124_439_808             # GPT-2 small, lm_head tied to wte: counted once


def test_unknown_model_is_named():
    with pytest.raises(ValueError, match="no-such-model"):
        model_info("no-such-model")


# --- activations ---------------------------------------------------------------------------------

def test_activation_formula_korthikanti():
    s, b, h, L, a = 2048, 2, 4096, 32, 32
    per_layer = s * b * h * 34 + 5 * a * s * s * b          # s b h (34 + 5 a s / h)
    assert activation_bytes(s, b, h, L, a) == L * per_layer
    assert activation_bytes(s, b, h, L, a, checkpointing="selective") == L * 34 * s * b * h
    assert activation_bytes(s, b, h, L, a, checkpointing="full") == 2 * L * s * b * h + per_layer
    assert activation_bytes(s, b, h, L, a, attention_scores=False) == L * 34 * s * b * h
    with pytest.raises(ValueError, match="checkpointing"):
        activation_bytes(s, b, h, L, a, checkpointing="some")


# --- parsing -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [("7e9", 7 * 10**9), ("7B", 7 * 10**9), ("6.7b", 6_700_000_000),
                                       ("350M", 350 * 10**6), ("1.5T", 1_500_000_000_000), ("12", 12),
                                       ("1.1B", 1_100_000_000), ("1.5B", 1_500_000_000), ("2.0", 2), (7e9, 7 * 10**9)])
def test_parse_count(text, want):
    assert parse_count(text) == want


@pytest.mark.parametrize("text,want", [("80GB", 80 * GB), ("80GiB", 80 * GiB), ("1TB", 10**12),
                                       ("512MiB", 512 * 2**20), ("4096", 4096), ("80G", 80 * GB), ("80g", 80 * GB),
                                       ("1Gi", GiB), ("1.5M", 1_500_000), ("256K", 256_000), ("256KiB", 2**18),
                                       ("2P", 2 * 10**15)])
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


def test_every_tool_parses_sizes_alike():
    """``1G`` is 1e9 bytes and ``1GiB`` 2**30 in zeroinf plan/estimate, tune-io and bench/aio alike."""
    from zeroinf.io import tune
    from zeroinf.sizes import format_bytes, parse_bytes as common
    for text in ("1G", "1GiB", "256KiB", "3M", "12"):
        assert parse_bytes(text) == tune.parse_bytes(text) == common(text), text
    assert common("1G") == 10**9 and common("1GiB") == 2**30
    for n in (2**18, 3 * 2**30, 10**9, 1500, 4097):
        assert common(format_bytes(n)) == n
    assert format_bytes(2**18) == "256KiB" and format_bytes(10**9) == "1G"


@pytest.mark.parametrize("fn,text", [(parse_count, "7 apples"), (parse_count, "0"), (parse_bytes, "80 GBs"),
                                     (parse_bytes, "-1GB")])
def test_parse_errors(fn, text):
    with pytest.raises(ValueError, match="expected|must be"):
        fn(text)


@pytest.mark.parametrize("text,says", [("1.5", "1.5 is not"), ("1.0000000001B", "1000000000.1 is not"), (2.5, "2.5 is not")])
def test_parse_count_refuses_a_fraction_of_a_parameter(text, says):
    """``--params 1.5`` was rounded to P = 2 (tester-30 t13)."""
    with pytest.raises(ValueError, match=f"parameter count {text!r}: {says} a whole number of parameters"):
        parse_count(text)


# --- command line --------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["estimate", "plan"])
@pytest.mark.parametrize("flag", ["--micro-batch", "--seq-len", "--hidden", "--layers", "--heads"])
def test_cli_sizes_below_1_name_their_flag(tmp_path, capsys, command, flag):
    """``estimate --micro-batch -3`` was taken (it counts only with --seq-len), and the shape flags
    were named by their keyword ("activation memory: hidden must be ...")."""
    shape = {"--seq-len": "16", "--hidden": "64", "--layers": "2", "--heads": "4", flag: "0"}
    argv = [command, "--params", "1e6", *[x for kv in shape.items() for x in kv]]
    if command == "plan":
        argv += ["--gpu-mem", "80GB", "--cpu-mem", "1TB", "--out", str(tmp_path / "p.json")]
    assert cli.main(argv) == 2
    got = capsys.readouterr()
    assert got.out == "" and got.err.splitlines() == [f"zeroinf {command}: error: {flag}: must be >= 1, got 0"]
    assert not list(tmp_path.iterdir())


def test_cli_micro_batch_below_1_without_seq_len_exits_2(capsys):
    assert cli.main(["estimate", "--params", "1e6", "--micro-batch", "-3"]) == 2
    got = capsys.readouterr()
    assert got.out == "" and got.err == "zeroinf estimate: error: --micro-batch: must be >= 1, got -3\n"


def test_estimate_nvme_rows_are_the_ones_plan_writes(tmp_path, capsys):
    """estimate's table says its NVMe rows are "as zeroinf plan writes", but sized the parameter
    buffers at 1e8 elements while plan writes the largest unit's partition: llama-7b on 8 ranks,
    host 36.80 GB against plan's 31.42 (helper-33, t31_estimate_vs_plan.sh)."""
    def row(argv):
        assert cli.main(argv + ["--json"]) == 0
        rows = json.loads(capsys.readouterr().out)["rows"]
        return next(r for r in rows if (r["stage"], r["offload_param"], r["offload_optimizer"]) == (3, "nvme", "nvme"))
    # (--cpu-mem 35GB: with 45 GB the plan is stage 3 none/nvme, since its optimizer buffers hold one
    # unit partition's sub-group, not 1e8 elements)
    assert cli.main(["plan", "--model", "llama-7b", "--gpus", "8", "--gpu-mem", "4GB", "--cpu-mem", "35GB",
                     "--nvme", "8TB", "--out", str(tmp_path / "plan.json")]) == 0
    capsys.readouterr()
    planned = row(["estimate", "--model", "llama-7b", "--gpus", "8", "--config", str(tmp_path / "plan.json")])
    assert row(["estimate", "--model", "llama-7b", "--gpus", "8", "--stage", "3"]) == planned

def test_cli_json_llama65b(capsys):
    rc = cli.main(["estimate", "--params", "65e9", "--gpus", "8", "--nodes", "16", "--precision", "fp16", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["params"], out["world_size"], len(out["rows"])) == (65 * 10**9, 128, 18)
    assert set(out["rows"][0]) == {"stage", "offload_param", "offload_param_ratio", "offload_optimizer", "per_device_bytes",
                                   "per_host_bytes", "nvme_bytes", "pinned_bytes_per_rank",
                                   "pinned_bytes_per_rank_cuda"}
    plain = {r["stage"]: r["per_device_bytes"] for r in out["rows"]
             if r["offload_param"] == r["offload_optimizer"] == "none"}
    # stage 3 adds its working set: without the units, min(P, stage3_max_live_parameters 1e9)
    # gathered parameters and gradients, 2 + 2 bytes each
    assert plain == {0: 1040 * GB, 1: 266_093_750_000, 2: 137_109_375_000, 3: 8_125_000_000 + 4 * 10**9}
    # stage 2 + optimizer on CPU: 8 ranks per node each keep 16 B x P/N on the host
    row = next(r for r in out["rows"] if (r["stage"], r["offload_optimizer"]) == (2, "cpu"))
    assert (row["per_device_bytes"], row["per_host_bytes"]) == (130 * GB, 8 * 16 * 507_812_500)
    # torch pins its fp32 gradient partition with CUDA only (pin_memory false: not the optimizer state)
    assert (row["pinned_bytes_per_rank"], row["pinned_bytes_per_rank_cuda"]) == (0, 4 * 507_812_500)


def test_cli_table_says_units(capsys):
    assert cli.main(["estimate", "--params", "7B", "--unit", "GiB", "--stage", "3", "--terms"]) == 0
    out = capsys.readouterr().out
    assert "GiB (2**30 bytes)" in out and "ceil(P/N)" in out
    assert f"{16 * 7e9 / GiB:,.2f}" in out


def test_cli_with_config_and_activations(tmp_path, capsys):
    cfg = {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True},
           "zero_optimization": {"stage": 3, "sub_group_size": 1000,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3,
                                                       "pipeline_read": True},
                                 "offload_param": {"device": "cpu"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    rc = cli.main(["estimate", "--params", "1e6", "--gpus", "2", "--config", str(path), "--json",
                   "--seq-len", "8", "--hidden", "4", "--layers", "2", "--heads", "2"])
    assert rc == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert (row["stage"], row["offload_param"], row["offload_optimizer"]) == (3, "cpu", "nvme")
    act = 2 * (8 * 4 * 34 + 5 * 2 * 64)
    # the working set with units unknown: min(P, stage3_max_live_parameters) = 1e6 parameters
    # gathered with their gradients, fp16: 2 + 2 bytes each (it read 0 with the parameters offloaded)
    assert row["per_device_bytes"] == act + (2 + 2) * 10**6
    # params, fp32 grads, min(3 buffers, 500 sub-groups) x round_up(12 B x 1000, 4096): with
    # pipeline_read every buffer is filled by the prefetch during the last backward
    per_rank_host = 2 * 500_000 + 4 * 500_000 + 3 * 12_288
    assert row["per_host_bytes"] == 2 * per_rank_host
    assert row["nvme_bytes"] == 2 * 12 * 500_000


def test_cli_errors_name_the_input(tmp_path, capsys):
    assert cli.main(["estimate", "--model", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 5}}))
    assert cli.main(["estimate", "--params", "1e6", "--config", str(bad)]) == 2
    assert "zero_optimization.stage" in capsys.readouterr().err
    assert cli.main(["estimate", "--params", "1e6", "--seq-len", "8"]) == 2
    assert "--hidden" in capsys.readouterr().err


@pytest.mark.parametrize("precision,param_tier,want", [("fp32", "nvme", 8), ("fp32", "cpu", 8), ("fp32", "none", 12),
                                                       ("bf16", "nvme", 12)])
def test_optimizer_state_bytes_agree_with_the_engines_swap_files(tmp_path, precision, param_tier, want):
    """fp32 stage 3 with the optimizer on NVMe and the parameters off the device keeps no master
    copy of its own (the partitions are the masters): K = 8 there, as the engine's swap-file
    count (``swap_file_bytes``, checked against the files on disk in test_stage3_engine_buffers) says."""
    torch = pytest.importorskip("torch")
    from zeroinf.runtime.stage3.engine_glue import swap_file_bytes

    e = estimate(10**6, Placement(3, param_tier, "nvme"), precision=precision)
    (term,) = [t for t in e.terms if t.name == "optimizer state (fp32)"]
    assert term.bytes == want * 10**6, term
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 100))
    z = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
         "offload_param": {"device": param_tier, **({"nvme_path": str(tmp_path)} if param_tier == "nvme" else {})}}
    cfg = parse_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": z,
                        **({"bf16": {"enabled": True}} if precision == "bf16" else {})})
    if precision == "bf16":
        model.to(torch.bfloat16)
    files = swap_file_bytes(model, cfg, [list(model.parameters())])
    (opt,) = [f for f in files if f[-1].startswith("optimizer state")]
    assert opt[3] == want * sum(p.numel() for p in model.parameters()), opt


def test_cli_config_parameter_buffers_hold_one_partition_at_most(capsys):
    """A config's buffer_size (the infinity preset's 1e8 elements) was taken as is: 2.00 GB of
    parameter buffers per host for a 133,440-parameter model whose run pins 3.6 MiB; the engine
    sizes a buffer at the largest partition (helper-46)."""
    preset = Path(__file__).parents[1] / "zeroinf" / "presets" / "infinity.json"
    assert cli.main(["estimate", "--params", "133440", "--config", str(preset), "--json", "--terms"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert (row["offload_param"], row["per_host_bytes"] < 16 << 20) == ("nvme", True), row


# --- pinned host memory against a real run -------------------------------------------------------
# zeroinf estimate's pinned bytes per rank (the JSON's figure for this host: with or without CUDA)
# against engine.stats()["pinned_bytes"] after two steps of the presets zeroinf train offers, on a
# model whose sizes are no multiple of a page: 300*301 + 301 + 301*7 + 7 = 92,715 parameters (one
# param group, so the partitions have no padding the estimate does not know). Equal to the byte.
# Without CUDA only the swap pools are locked (0 for the cpu preset; the estimate used to count
# its 4-byte fp32 gradient partition as pinned: helper r08 saw 0.0005 GiB against 0.0 MiB).
@pytest.mark.parametrize("preset", ["cpu", "nvme-optimizer", "infinity"])
def test_estimate_pinned_bytes_equal_a_runs(preset, tmp_path, capsys):
    import torch
    import torch.nn.functional as F
    from torch import nn

    import zeroinf

    if torch.cuda.is_available():  # the CUDA figure describes a model on the GPU (its pinned host
        pytest.skip("copy is the fp32 master); this run keeps the model on the CPU")

    cfg = json.loads((Path(zeroinf.__file__).parent / "presets" / f"{preset}.json").read_text())
    for off in ("offload_param", "offload_optimizer"):
        if "nvme_path" in cfg["zero_optimization"].get(off, {}):
            cfg["zero_optimization"][off]["nvme_path"] = str(tmp_path / "nvme")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 301), nn.Tanh(), nn.Linear(301, 7))
    params = sum(p.numel() for p in model.parameters())
    assert params == 92_715
    engine, *_ = zeroinf.initialize(model, config=cfg)
    x, y = torch.randn(8, 300), torch.randn(8, 7)
    for _ in range(2):
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    pinned = engine.stats()["pinned_bytes"]
    engine.close()
    assert cli.main(["estimate", "--params", str(params), "--config", str(path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    if cfg["zero_optimization"]["stage"] < 3:
        assert row["pinned_bytes_per_rank"] == pinned
    else:  # --params does not know stage 3's units: an upper bound (4 optimizer buffers, pipeline_read) ...
        assert row["pinned_bytes_per_rank"] > pinned
        # ... exact with the engine's one unit (every parameter under the persistence threshold 1e5)
        parsed = parse_config(cfg)
        est = estimate(params, placement_from_config(parsed), precision=parsed.precision,
                       swap=swap_buffers_from_config(parsed), unit_sizes=(params,))
        assert est.pinned_bytes(cuda=False) == pinned
    if preset == "cpu":
        assert pinned == 0


# The same at stage 3 with several units: a Llama of 3 blocks (50,304 elements each), a root unit
# (embedding, norm, lm_head: 32,832) and, with stage3_param_persistence_threshold 0, no persistent
# unit. The engine cuts the optimizer's sub-groups per unit partition and sizes every swap buffer
# by the largest one; the estimate used to take ceil(P/N) = 183,744 elements as one sub-group
# (tester-33 t12: nvme/nvme pinned 1,429,504 bytes, estimated 2,093,056; with pipeline_read
# 2,240,512, estimated 2,093,056). Optimizer buffers (fp32: K = 8, the partitions are the masters;
# bf16: K = 12) and parameter buffers (Ψp x 50,304, at least 2 with prefetch), rounded up to pages:
ZERO_THRESHOLD_CASES = {
    # 1 buffer in flight of 8 x 50,304 B -> 405,504; 5 parameter buffers of 4 x 50,304 B -> 204,800
    "nvme-nvme": ({}, {}, {}, False, 405_504 + 5 * 204_800),
    # parameter buffer_count 1 is raised to 2 (one unit read ahead)
    "param-buffer_count-1": ({"buffer_count": 1}, {}, {}, False, 405_504 + 2 * 204_800),
    # pipeline_read: min(buffer_count 8, 4 sub-groups) of 12 x 50,304 B -> 606,208; 2 x 50,304 B -> 102,400
    "pipeline_read-bf16": ({}, {"pipeline_read": True, "buffer_count": 8}, {}, True, 4 * 606_208 + 5 * 102_400),
    # sub_group_size 30,000: 2 sub-groups per unit = 8 (ceil(P/30,000) = 7); min(8, 8) of 8 x 30,000 B
    # -> 241,664; 2 parameter buffers
    "sub_group_size-pipelined": ({"buffer_count": 2}, {"pipeline_read": True, "pipeline_write": True, "buffer_count": 8},
                                 {"sub_group_size": 30_000}, False, 8 * 241_664 + 2 * 204_800),
}


@pytest.mark.parametrize("case", list(ZERO_THRESHOLD_CASES))
def test_estimate_pinned_bytes_equal_a_stage3_run_of_several_units(case, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import zeroinf

    if torch.cuda.is_available():
        pytest.skip("the CUDA figure describes a model on the GPU; this run keeps the model on the CPU")
    param, opt, zero, bf16, want = ZERO_THRESHOLD_CASES[case]
    nvme = str(tmp_path / "nvme")
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": bf16},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero,
                                 "offload_param": {"device": "nvme", "nvme_path": nvme, **param},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": nvme, **opt}}}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    llama = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                 tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **llama}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**llama))
    if bf16:
        model.to(torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == 32_832 + 3 * 50_304
    engine, *_ = zeroinf.initialize(model, config=cfg)
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    pinned = engine.stats()["pinned_bytes"]
    engine.close()
    assert pinned == want
    assert cli.main(["estimate", "--model", str(tmp_path), "--config", str(tmp_path / "ds.json"), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["pinned_bytes_per_rank"] == pinned
    # --params alone (units unknown) stays an upper bound
    assert cli.main(["estimate", "--params", str(32_832 + 3 * 50_304), "--config", str(tmp_path / "ds.json"),
                     "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["pinned_bytes_per_rank"] >= pinned


def test_format_size_is_positional_with_three_significant_digits_below_one():
    from zeroinf.estimate import format_size
    assert format_size(0) == "0.00"
    assert format_size(1_234_567_890) == "1.23" and format_size(12_345_678_901_234) == "12,345.68"
    assert format_size(328_000_000) == "0.328" and format_size(900_000_000) == "0.9"
    assert format_size(16_000) == "0.000016" and format_size(100) == "0.0000001"
    assert format_size(999_600) == "0.001"  # rounds up to the next power of ten
    assert format_size(2**30, "GiB") == "1.00" and format_size(2**20, "GiB") == "0.000977"
    for n in (1, 7, 100, 12_345, 999_999, 10**8):
        assert "e" not in format_size(n) and float(format_size(n)) == float(f"{n / 1e9:.3g}")
