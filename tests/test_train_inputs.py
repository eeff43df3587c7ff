"""What ``zeroinf train`` reads and how: deterministic batches split over ranks, a jsonl corpus, the
model named after its --init folder, loss windows, the files a resumed run reads, --dtype beside
a config's precision blocks, and a batch of every row the corpus holds."""
import json

import pytest
import torch

from zeroinf.data import Batches, ByteTokenizer, DataError, load_tokens
from train_helpers import _log, _train


def test_batches_are_deterministic_and_split_over_ranks():
    tokens = torch.arange(10_000) % 256
    one = Batches(tokens, 16, 4, seed=3).get(step=5, micro_step=1, rank=0, world_size=1)
    halves = [Batches(tokens, 16, 2, seed=3).get(5, 1, rank=r, world_size=2) for r in (0, 1)]
    assert torch.equal(torch.cat(halves), one)
    assert not torch.equal(one, Batches(tokens, 16, 4, seed=3).get(6, 1))
    # rows are contiguous windows of the corpus
    assert bool((((one[:, 1:] - one[:, :-1]) % 256) == 1).all())


def test_jsonl_corpus_and_its_errors(tmp_path):
    good = tmp_path / "c.jsonl"
    good.write_text(json.dumps({"text": "héllo"}) + "\n\n" + json.dumps({"text": "world"}) + "\n")
    ids = load_tokens(str(good), ByteTokenizer(), 4)
    assert bytes(ids.tolist()) == "héllo\nworld".encode()
    mangled = tmp_path / "mangled.jsonl"  # invalid UTF-8 is replaced, as in .txt files (helper-46 t04)
    mangled.write_bytes(b'{"text": "a\xffb"}\n')
    assert bytes(load_tokens(str(mangled), ByteTokenizer(), 1).tolist()) == "a\ufffdb".encode()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"body": "b"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: .*\"text\""):
        load_tokens(str(bad), ByteTokenizer(), 1)


def test_the_model_is_named_after_its_init_folder(tmp_path):
    """An --init Hugging Face folder names the run's model (its own architecture), not the default
    --model/--size it overrides."""
    import transformers

    from zeroinf.models import build_config
    from zeroinf.cli.train import model_name
    transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=256).save_pretrained(tmp_path / "gpt")
    mcfg = build_config("llama", "tiny", 256, 64, str(tmp_path / "gpt"))
    assert mcfg.model_type == "gpt2"
    assert model_name("llama", "tiny", str(tmp_path / "gpt") + "/", mcfg) == "gpt (gpt2)"
    assert model_name("llama", "tiny", None, build_config("llama", "tiny")) == "llama tiny"
    assert model_name("/a/cfg.json", "tiny", None, mcfg) == "cfg.json (gpt2)"


@pytest.mark.parametrize("n,k", [(1, 1), (2, 1), (5, 2), (9, 4), (10, 5), (40, 5)])
def test_loss_windows_never_overlap(n, k):
    from zeroinf.cli.train import loss_label, loss_windows
    losses = [float(3 ** i) for i in range(n)]  # every window has its own mean
    got_k, first, last = loss_windows(losses)
    assert got_k == k and (n == 1 or 2 * k <= n)
    assert first == sum(losses[:k]) / k and last == sum(losses[n - k:]) / k
    assert loss_label(k, n) == ("loss (1 step)" if n == 1 else f"loss first {k} -> last {k}")


def _resolved(argv, cwd, monkeypatch):
    """``zeroinf train`` arguments as the run resolves them in ``cwd`` (no training)."""
    import argparse

    from zeroinf.cli.train import _Run, add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    monkeypatch.chdir(cwd)
    return _Run(p.parse_args(argv))._resolve_args()


def test_resume_from_another_directory_reads_the_files_the_run_read(tmp_path, monkeypatch):
    """Paths were stored in run.json as typed: a --resume from another directory holding a file
    of the same relative name trained on it, the loss jumping 0.15 -> 8.3 (helper-46 t05)."""
    from zeroinf.cli.train import TrainError
    (tmp_path / "a" / "data").mkdir(parents=True)
    (tmp_path / "b" / "data").mkdir(parents=True)
    a = _resolved(["--data", "data/d.txt", "--out", "run"], tmp_path / "a", monkeypatch)
    assert a.data == str(tmp_path / "a" / "data" / "d.txt") and a.out == str(tmp_path / "a" / "run")
    run = tmp_path / "a" / "run"
    (run / "checkpoint" / "step3").mkdir(parents=True)
    (run / "checkpoint" / "latest").write_text("step3")
    (run / "run.json").write_text(json.dumps({"args": {k: v for k, v in vars(a).items() if k != "resume"},
                                              "completed_steps": 3}))
    resumed = _resolved(["--resume", str(run)], tmp_path / "b", monkeypatch)
    assert resumed.data == a.data and resumed.out == str(run)
    assert _resolved(["--resume", str(run), "--data", "../a/data/d.txt"], tmp_path / "b", monkeypatch).data == a.data
    with pytest.raises(TrainError, match=r"--data .*b/data/d.txt"):
        _resolved(["--resume", str(run), "--data", "data/d.txt"], tmp_path / "b", monkeypatch)
    # named through a symlink: the same file, not a change (helper-48 P8)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert _resolved(["--resume", str(run), "--data", str(tmp_path / "link" / "data" / "d.txt")], tmp_path / "b",
                     monkeypatch).data == a.data
    # run.json of an older version: paths as typed, relative to a working directory it did not
    # record; resolved against today's, the resume trained on b's file (helper-48 P1). The
    # directory is the run folder less its stored relative out
    old = {**json.loads((run / "run.json").read_text())}
    old["args"] = {**old["args"], "data": "data/d.txt", "out": "run"}
    (run / "run.json").write_text(json.dumps(old))
    assert _resolved(["--resume", str(run)], tmp_path / "b", monkeypatch).data == a.data
    old["args"]["out"] = "elsewhere/run"  # not the run folder's tail: cannot tell
    (run / "run.json").write_text(json.dumps(old))
    with pytest.raises(TrainError, match=r"run.json stores --data relative to a working directory"):
        _resolved(["--resume", str(run)], tmp_path / "b", monkeypatch)


def test_a_batch_of_every_row_the_corpus_holds_trains(tmp_path):
    """The bound above is the most rows, not one short of it."""
    (tmp_path / "small.txt").write_text("hello world, " * 10)
    _train(["--offload", "none", "--data", "small.txt", "--seq-len", "64", "--micro-batch", "66", "--steps", "1",
            "--no-plot", "--out", "out"], tmp_path)
    assert [(r["step"], r["tokens"]) for r in _log(tmp_path / "out")] == [(1, 66 * 64)]


def test_dtype_keeps_the_configs_precision_blocks_and_nvme_in_any_case_takes_nvme_path(tmp_path, monkeypatch):
    """--dtype fp16 replaced the config's fp16 block (its loss scaling lost: helper-46 t02), with
    DeepSpeed's "bfloat16" alias it made a pair the check refuses (t03), and a device spelt "NVMe"
    ignored --nvme-path (t07)."""
    from zeroinf.config import parse_config
    from zeroinf.cli.train import _Run
    cfg = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": False, "initial_scale_power": 3},
           "bfloat16": {"enabled": True},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "NVMe", "nvme_path": "/elsewhere"}}}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    for dtype in ("fp16", "fp32", "bf16"):
        a = _resolved(["--config", str(path), "--dtype", dtype, "--nvme-path", "nv"], tmp_path, monkeypatch)
        run = _Run(a)
        built = run._build_config(a)
        parsed = parse_config(built)
        assert parsed.precision == dtype
        if dtype == "fp16":
            assert built["fp16"] == {"enabled": True, "initial_scale_power": 3}
            assert parsed.fp16.initial_scale_power == 3
        assert built["zero_optimization"]["offload_optimizer"]["nvme_path"] == str(tmp_path / "nv")
        assert parsed.zero_optimization.offload_optimizer.device == "nvme"
