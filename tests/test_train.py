"""``zeroinf train`` end to end: a tiny Llama on the standard library, params and optimizer on NVMe.

Each run is a real subprocess (``python -m zeroinf train``), as a user would start it. Sizes are
tiny (133k parameters, seq 64, 20 steps) so the whole file stays well under a minute and a half.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from zeroinf.data import Batches, ByteTokenizer, DataError, load_tokens
from zeroinf.cli.train import COMPARE_ATOL, LOG_FIELDS

#: the strongest offload the main job offers: parameters and optimizer state on NVMe
OFFLOAD = "infinity"
TINY = ["--size", "tiny", "--seq-len", "64", "--micro-batch", "4", "--seed", "0"]


def _train(args, cwd, timeout=240, check=True):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "zeroinf", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"zeroinf train {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _start(args, cwd, out, steps_done):
    """Start ``zeroinf train ARGS --out OUT`` in ``cwd`` and return it once OUT/log.jsonl holds
    ``steps_done`` steps (stdout piped, stderr too)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "zeroinf", "train", *args, "--out", out], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = Path(cwd) / out / "log.jsonl"
    deadline = time.time() + 180
    while (not log.exists() or len(log.read_text().splitlines()) < steps_done) and proc.poll() is None:
        assert time.time() < deadline, f"the run wrote no {steps_done} steps in time"
        time.sleep(0.01)
    return proc


def _log(out):
    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    """20 steps with --offload infinity and --compare, in a fresh working directory."""
    cwd = tmp_path_factory.mktemp("main_run")
    proc = _train(["--offload", OFFLOAD, "--steps", "20", *TINY, "--compare", "--out", "out"], cwd)
    return cwd, proc


def test_loss_goes_down_and_log_is_complete(main_run):
    cwd, proc = main_run
    assert f"; swap files in {cwd}{os.sep}.zeroinf-nvme-r0-" in proc.stdout  # where the header says they go
    recs = _log(cwd / "out")
    assert [r["step"] for r in recs] == list(range(1, 21))
    for r in recs:
        assert set(LOG_FIELDS) <= set(r), sorted(set(LOG_FIELDS) - set(r))
        assert np.isfinite(r["loss"]) and r["tokens"] == 4 * 64 and r["tokens_per_s"] > 0
        assert r["grad_norm"] is not None and r["grad_norm"] > 0
        assert r["rss_bytes"] > 0 and r["step_s"] > 0
    first, last = np.mean([r["loss"] for r in recs[:5]]), np.mean([r["loss"] for r in recs[-5:]])
    assert last < first - 0.1, (first, last)
    # the swap files were really on "NVMe" (the swap directory) while training ...
    assert max(r["nvme_bytes"] for r in recs) > 0
    # ... and the private default swap directory is gone afterwards (no --keep)
    assert not list(cwd.glob(".zeroinf-nvme-*"))


def test_png_and_summary(main_run):
    import matplotlib.image
    cwd, proc = main_run
    img = matplotlib.image.imread(cwd / "out" / "loss.png")
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    summary = json.loads((cwd / "out" / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["params"] == 133440
    # the kernel's high-water mark lagged a step's sample (helper-46)
    assert summary["peak_rss_bytes"] >= max(r["rss_bytes"] for r in _log(cwd / "out"))
    assert "tokens/s" in proc.stdout and "loss first 5 -> last 5" in proc.stdout


def test_compare_passes_against_plain_pytorch(main_run):
    cwd, proc = main_run
    cmp = json.loads((cwd / "out" / "compare.json").read_text())
    assert len(cmp["reference"]) == 20 and cmp["max_abs_diff"] <= COMPARE_ATOL["fp32"]
    ref0 = cmp["reference"][0]
    # the step-1 loss of a random byte-level model is about ln(256)
    assert abs(ref0 - np.log(256)) < 0.2
    assert "PASS" in proc.stdout


@pytest.mark.parametrize("case", ["data", "config", "nvme"])
def test_bad_input_exits_with_one_line(case, tmp_path, capsys, monkeypatch):
    from zeroinf.cli import main
    monkeypatch.chdir(tmp_path)
    if case == "data":
        culprit = str(tmp_path / "no-such-corpus.txt")
        argv = ["--data", culprit]
    elif case == "config":
        cfg = json.loads((Path(__file__).parents[1] / "zeroinf" / "presets" / "none.json").read_text())
        cfg["zero_optimization"]["offload_optimiser"] = {"device": "cpu"}   # misspelt key
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(cfg))
        culprit = "zero_optimization.offload_optimiser"
        argv = ["--config", str(path)]
    else:
        (tmp_path / "a-file").write_text("x")
        culprit = str(tmp_path / "a-file" / "swap")            # parent is a file: cannot be created
        argv = ["--offload", "nvme-optimizer", "--nvme-path", culprit]
    code = main(["train", *argv, "--steps", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1 and culprit in err[0], err
    assert not list(tmp_path.glob(".zeroinf-nvme-*"))     # the private swap dir went too


def test_two_ranks_agree_with_one(main_run, tmp_path):
    """2 ranks x micro-batch 2 see the rows of 1 rank x micro-batch 4 (the main run)."""
    args = ["--offload", OFFLOAD, "--steps", "4", *TINY, "--micro-batch", "2", "--no-plot", "--compare",
            "--out", "two"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "zeroinf", "train", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, two = _log(main_run[0] / "out")[:4], _log(tmp_path / "two")
    assert "2 rank(s) x micro-batch 2" in proc.stdout and "PASS" in proc.stdout   # rank 0's --compare
    # the header named rank 0's private swap folder only (tester-34)
    assert f"; swap files in {tmp_path}{os.sep}.zeroinf-nvme-r0-" in proc.stdout, proc.stdout
    assert "(rank 0's; rank 1 has its own .zeroinf-nvme-rN- beside it)" in proc.stdout, proc.stdout
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one] == [4 * 64] * 4
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=0, atol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in two], [r["grad_norm"] for r in one], rtol=1e-4)


def test_interrupt_and_resume_reproduce_the_trajectory(main_run, tmp_path):
    """Ctrl-C after step 3 or later, then --resume: the 20 losses of the uninterrupted main run."""
    args = ["--offload", OFFLOAD, "--steps", "20", *TINY, "--no-plot"]
    proc = _start(args, tmp_path, "cut", 3)
    proc.send_signal(signal.SIGINT)            # what Ctrl-C sends
    out, err = proc.communicate(timeout=120)
    stopped = len(_log(tmp_path / "cut"))
    assert proc.returncode == 130 and 3 <= stopped < 20, (proc.returncode, stopped, err[-2000:])
    assert "Traceback" not in err and f"--resume {tmp_path / 'cut'}" in out
    # a fresh run into it kept the old run.json and checkpoint until it ended: killed before, a
    # --resume went on from the old checkpoint with the new run's log (helper-46 t09)
    bad = _train([*args, "--seed", "1", "--out", "cut"], tmp_path, check=False)
    assert bad.returncode == 2 and "holds an interrupted run" in bad.stderr, bad.stderr
    # a flag the resumed run cannot honour was dropped silently (helper-40 f07): refused, naming it
    bad = _train(["--resume", "cut", "--offload", "cpu", "--lr", "0.5", "--out", "other"], tmp_path, check=False)
    assert bad.returncode == 2 and "--offload 'cpu' (the run has 'infinity'), --lr 0.5 (the run has " in bad.stderr, bad.stderr
    assert f"--out {str(tmp_path / 'other')!r} (a resumed run writes to its own folder" in bad.stderr
    # --steps at or below the steps done ran nothing and dropped the resume point (helper-42 f03)
    bad = _train(["--resume", "cut", "--steps", str(stopped)], tmp_path, check=False)
    assert bad.returncode == 2 and f"has completed {stopped} steps already" in bad.stderr, bad.stderr
    ckpt = tmp_path / "cut" / "checkpoint"
    (ckpt / f"step{stopped}").rename(ckpt / f"step{stopped + 1}")   # the tag and the checkpoint disagree
    (ckpt / "latest").write_text(f"step{stopped + 1}")
    bad = _train(["--resume", "cut"], tmp_path, check=False)
    assert bad.returncode == 2 and f"checkpoint/step{stopped + 1} holds step {stopped}" in bad.stderr, bad.stderr
    (ckpt / f"step{stopped + 1}").rename(ckpt / f"step{stopped}")
    (ckpt / "latest").write_text(f"step{stopped}")
    _train(["--resume", "cut"], tmp_path)
    full, cut = _log(main_run[0] / "out"), _log(tmp_path / "cut")
    assert [r["step"] for r in cut] == list(range(1, 21))
    np.testing.assert_allclose([r["loss"] for r in cut], [r["loss"] for r in full], rtol=0, atol=1e-6)
    # the run completed: its interruption's checkpoint no longer says where it stands. A --resume
    # --steps 30 took it up and numbered its steps 21.. from run.json, 10 steps of training lost
    # silently (helper-40 f06); it is refused now
    more = _train(["--resume", "cut", "--steps", "30"], tmp_path, check=False)
    assert more.returncode == 2 and "the run completed its 20 steps" in more.stderr, more.stderr


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


def test_init_from_safetensors_reproduces_the_seeded_model(main_run, tmp_path):
    """--init with the seed-0 weights saved to a file trains exactly like the seed-0 random init."""
    from safetensors.torch import save_file
    from zeroinf.models import build_config, build_model
    model = build_model(build_config("llama", "tiny"), seed=0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "w.safetensors"))
    _train(["--offload", OFFLOAD, "--steps", "2", *TINY, "--init", "w.safetensors", "--no-plot", "--out", "o"],
           tmp_path)
    got, want = _log(tmp_path / "o"), _log(main_run[0] / "out")[:2]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=0, atol=1e-6)
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["model"] == "w.safetensors (llama)"
    wrong = {k: v for k, v in model.state_dict().items() if not k.endswith("norm.weight")}
    save_file({k: v.contiguous() for k, v in wrong.items()}, str(tmp_path / "partial.safetensors"))
    proc = _train(["--init", "partial.safetensors", "--steps", "1", "--out", "p"], tmp_path, check=False)
    assert proc.returncode == 2 and "partial.safetensors" in proc.stderr and "missing keys" in proc.stderr


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


@pytest.mark.parametrize("argv,says", [
    (["--seed", "-1"], "--seed -1: must be in [0, 2**32)"),     # a numpy traceback after the log was wiped
    (["--out", ""], "--out '': give a folder"),                 # wrote the outputs into the working directory
    (["--out", "a-file"], "exists and is not a folder"),         # FileExistsError traceback after the model was built
    (["--out", "a-file/sub"], "cannot be created"),              # NotADirectoryError traceback
])
def test_bad_seed_and_out_exit_with_one_line(argv, says, tmp_path, capsys, monkeypatch):
    """helper-46 t10, t11."""
    from zeroinf.cli import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("x")
    code = main(["train", "--offload", "none", "--steps", "1", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err
    assert (tmp_path / "a-file").read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize("batch,says", [
    ({"train_micro_batch_size_per_gpu": 1e11}, "ds.json: train_micro_batch_size_per_gpu 100000000000: 100,000,000,000 rows"),
    ({"train_batch_size": 200}, "ds.json: train_batch_size 200 (train_micro_batch_size_per_gpu 200): 200 rows"),
    ({"--micro-batch": "67"}, "--micro-batch 67: 67 rows"),
], ids=["config-1e11", "train-batch-size", "flag"])
def test_a_batch_larger_than_the_corpus_exits_with_one_line(batch, says, tmp_path, capsys, monkeypatch):
    """``train_micro_batch_size_per_gpu`` 1e11 ended in numpy's ArrayMemoryError traceback, with
    --out made; 130 tokens hold 130 - 64 = 66 distinct 64-token rows, the most allowed."""
    from zeroinf.cli import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "small.txt").write_text("hello world, " * 10)
    cfg = json.loads((Path(__file__).parents[1] / "zeroinf" / "presets" / "cpu.json").read_text())
    del cfg["train_micro_batch_size_per_gpu"]
    cfg.update({k: v for k, v in batch.items() if not k.startswith("--")})
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    flags = [x for kv in batch.items() if kv[0].startswith("--") for x in kv]
    code = main(["train", "--config", "ds.json", "--data", "small.txt", "--seq-len", "64", "--steps", "1", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err
    advice = "give train_batch_size at most 66" if "train_batch_size" in batch else "give at most 66 rows per rank"
    assert err[0].endswith(f"over 1 rank(s), but {tmp_path / 'small.txt'} has 66 distinct 64-token sequences "
                           f"(130 tokens); {advice}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json", "small.txt"]


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


def test_a_diverged_run_exits_4_and_a_warmup_schedule_passes_compare(tmp_path):
    """A run whose loss went NaN exited 0 (helper-46 t08); log.jsonl's lr was the next step's, so
    --compare replayed a warm-up one step early and failed (exit 3: helper-46 t01)."""
    opt = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}
    warm = {"train_micro_batch_size_per_gpu": 4, "optimizer": opt, "zero_optimization": {"stage": 2},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                         "warmup_num_steps": 4, "warmup_type": "linear"}}}
    (tmp_path / "warm.json").write_text(json.dumps(warm))
    proc = _train(["--config", "warm.json", "--steps", "6", "--size", "tiny", "--seq-len", "64", "--compare",
                   "--no-plot", "--out", "warm"], tmp_path, check=False)
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    # DeepSpeed's WarmupLR: steps 1 and 2 at the minimum, then up by 1/4 of the range a step
    assert [r["lr"] for r in _log(tmp_path / "warm")] == pytest.approx([0.0, 0.0, 0.0025, 0.005, 0.0075, 0.01])
    nan = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "eps": 0}},
           "zero_optimization": {"stage": 2}}
    (tmp_path / "nan.json").write_text(json.dumps(nan))
    proc = _train(["--config", "nan.json", "--steps", "3", "--size", "tiny", "--seq-len", "64", "--no-plot",
                   "--compare", "--out", "nan"], tmp_path, check=False)
    losses = [r["loss"] for r in _log(tmp_path / "nan")]
    assert proc.returncode == 4 and not all(np.isfinite(losses)), (proc.returncode, losses)
    assert "the run diverged" in proc.stderr and (tmp_path / "nan" / "summary.json").is_file()
    assert "--compare skipped" in proc.stderr  # it was skipped without a word (helper-48 P6)


def test_nvme_column_counts_this_runs_swap_files_only(tmp_path):
    """The swap folders were summed whole: files an earlier run left there (swap files outlive
    close) counted as this run's, 4.6 MiB against 2.6 (helper-48 P2)."""
    swap = tmp_path / "nv" / "zeroinf_optimizer" / "rank0" / "zeroinf-swap"
    swap.mkdir(parents=True)
    (swap / "earlier_run-0123456789ab.swp").write_bytes(b"\1" * (8 << 20))
    _train(["--offload", "nvme-optimizer", "--nvme-path", "nv", "--steps", "2", *TINY, "--no-plot", "--out", "o"],
           tmp_path)
    ours = sum(p.stat().st_blocks * 512 for p in swap.iterdir() if p.suffix in (".swp", ".json")
               and not p.name.startswith("earlier_run"))
    assert 0 < ours < 8 << 20
    assert [r["nvme_bytes"] for r in _log(tmp_path / "o")] == [ours, ours]


def test_a_killed_runs_private_swap_folder_is_removed_by_the_next_run(tmp_path):
    """A run killed outright (SIGKILL; a second SIGTERM) cannot remove its private swap folder; the
    next run in that directory does, and leaves a live run's and a --keep run's alone."""
    from zeroinf.cli.train import make_private_dir, remove_stale_private_dirs
    proc = _start(["--offload", OFFLOAD, "--steps", "200", *TINY, "--no-plot"], tmp_path, "killed", 1)
    proc.kill()
    proc.communicate(timeout=60)
    (stale,) = tmp_path.glob(".zeroinf-nvme-r0-*")
    nbytes = sum(f.stat().st_size for f in stale.rglob("*") if f.is_file())
    assert nbytes > 0
    live, fd = make_private_dir(tmp_path, 0)            # a run still going: its folder stays
    kept, kfd = make_private_dir(tmp_path, 0, keep=True)
    os.close(kfd)                                        # a --keep run that ended: its folder stays
    rank1, r1fd = make_private_dir(tmp_path, 1)
    os.close(r1fd)                                       # rank 1 of a killed 2-rank run: removed too (tester-33 M7)
    older = tmp_path / ".zeroinf-nvme-r0-a8ct497w"      # an older version's (--keep?) folder: no OWNER, stays (M2)
    older.mkdir()
    (older / "x.swp").write_bytes(b"0" * 4096)
    try:
        proc = _train(["--offload", OFFLOAD, "--steps", "1", *TINY, "--no-plot", "--out", "next"], tmp_path)
        for d, n in ((stale, nbytes), (rank1, 0)):  # rank 1's holds its OWNER note only: 0.0 MiB
            assert f"removed {d.name} ({n / 2**20:.1f} MiB), the private swap folder of a run that ended without " \
                   "removing it (killed)" in proc.stderr, proc.stderr
        assert sorted(tmp_path.glob(".zeroinf-*")) == sorted([live, kept, older])
    finally:
        os.close(fd)
    assert [d for d, _ in remove_stale_private_dirs(tmp_path)] == [live]
    assert sorted(tmp_path.glob(".zeroinf-*")) == sorted([kept, older])


def test_an_empty_half_made_private_folder_is_removed_once_old(tmp_path):
    """A run killed between mkdtemp and writing OWNER left an empty .zeroinf-new-r folder that
    no later run removed (tester-34). An hour old and empty, it is removed; a fresh one (a run
    may be between those two calls) and one holding anything stay."""
    from zeroinf.cli.train import remove_stale_private_dirs
    old, fresh, full = (tmp_path / f".zeroinf-new-r{r}-abcdefg{r}" for r in range(3))
    for d in (old, fresh, full):
        d.mkdir()
    (full / "x").write_text("x")
    for d in (old, full):
        os.utime(d, (time.time() - 3700, time.time() - 3700))
    assert remove_stale_private_dirs(tmp_path) == [(old, 0)]
    assert sorted(tmp_path.iterdir()) == [fresh, full]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_another_users_private_swap_folder_is_left_alone(tmp_path):
    """In a shared directory (/tmp) another user's folder, even one looking stale, is not ours:
    Path.exists() on its 0700 contents raised PermissionError and train ended in a traceback
    (tester-33 M1); as root it was removed."""
    from zeroinf.cli.train import make_private_dir, remove_stale_private_dirs
    theirs, fd = make_private_dir(tmp_path, 0)
    os.close(fd)
    for p in (theirs, *theirs.iterdir()):
        os.chown(p, 65534, 65534)
    theirs.chmod(0o700)
    assert remove_stale_private_dirs(tmp_path) == [] and theirs.is_dir()


def test_only_folders_this_scheme_made_on_this_host_are_removed(tmp_path):
    """tester-34 N5: a name with a trailing newline and a folder whose OWNER is a link were taken
    for private swap folders; a folder another host made on a shared file system (whose flock
    may be local to each host) must not be taken either. A real stale one still goes."""
    from zeroinf.cli.train import make_private_dir, remove_stale_private_dirs
    stale, fd = make_private_dir(tmp_path, 0)
    os.close(fd)
    newline = tmp_path / (stale.name[:-1] + "x\n")
    newline.mkdir()
    (newline / "OWNER").write_text((stale / "OWNER").read_text())
    linked, fd = make_private_dir(tmp_path, 1)
    os.close(fd)
    (tmp_path / "owner-text").write_text((linked / "OWNER").read_text())
    (linked / "OWNER").unlink()
    (linked / "OWNER").symlink_to(tmp_path / "owner-text")
    other, fd = make_private_dir(tmp_path, 2)
    os.close(fd)
    (other / "OWNER").write_text("another-host\nzeroinf train, pid 1\n")
    assert [d for d, _ in remove_stale_private_dirs(tmp_path)] == [stale]
    assert newline.is_dir() and linked.is_dir() and other.is_dir() and (tmp_path / "owner-text").is_file()


def test_a_refused_run_leaves_no_empty_out_folder(tmp_path, capsys, monkeypatch):
    """--out (and its missing parents) was made before the model and the engine: a config the
    engine refused at initialize left an empty folder behind (tester-33). A folder that existed
    before the run stays."""
    from zeroinf.cli import main
    monkeypatch.chdir(tmp_path)
    cfg = json.loads((Path(__file__).parents[1] / "zeroinf" / "presets" / "infinity.json").read_text())
    for k in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][k]["nvme_path"] = str(tmp_path / "nv")
    cfg["zero_optimization"]["offload_param"]["buffer_size"] = 10  # below the largest unit partition
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    argv = ["train", "--config", "ds.json", *TINY, "--steps", "1", "--no-plot"]
    code = main([*argv, "--out", "a/b/o"])
    err = capsys.readouterr().err
    assert code == 2 and "buffer_size" in err, err
    assert not (tmp_path / "a").exists()
    (tmp_path / "kept").mkdir()
    assert main([*argv, "--out", "kept/o"]) == 2
    assert {p.name for p in tmp_path.iterdir()} - {"nv"} == {"ds.json", "kept"} and not any((tmp_path / "kept").iterdir())


def test_a_micro_batch_whose_logits_outgrow_memory_exits_with_one_line(tmp_path, capsys, monkeypatch):
    """--micro-batch 10000000 passed the corpus check and died in the allocator (or by the OOM
    killer) after the model was built (helper-49). 10,000 rows x 64 tokens x 256 fp32 logits and
    their gradient are 1.22 GiB: refused against 1 GiB free, before --out is made."""
    import collections

    import psutil

    from zeroinf.cli import main
    monkeypatch.chdir(tmp_path)
    free = collections.namedtuple("vm", "available total")(2**30, 2**34)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    code = main(["train", "--offload", "none", "--steps", "1", "--seq-len", "64", "--micro-batch", "10000",
                 "--out", "o"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == ("zeroinf train: error: --micro-batch 10000: the logits alone (10,000 x 64 tokens x vocabulary "
                      "256, fp32, and their gradient) take 1.2 GiB, but this host has 1.0 GiB free; give at most "
                      "8,192 rows per rank (activations come on top)")
    assert not (tmp_path / "o").exists()


def test_a_model_config_with_no_causal_lm_class_is_refused_in_one_line(tmp_path):
    """``--model`` given an encoder-decoder config (T5) ended in a traceback listing every
    causal-LM config class, exit 1 (tester-40 F5); it is a ModelError now, which the CLI prints
    as one line with exit 2."""
    from zeroinf.models import ModelError, build_config
    path = tmp_path / "t5.json"
    path.write_text(json.dumps({"model_type": "t5", "vocab_size": 300, "d_model": 32}))
    with pytest.raises(ModelError, match="model_type 't5' has no causal-LM class in transformers"):
        build_config(str(path))
    path.write_text(json.dumps({"model_type": "nosuchmodel", "hidden_size": 32}))
    with pytest.raises(ModelError, match=r"model_type 'nosuchmodel' is not known to transformers [\d.]+$"):
        build_config(str(path))  # transformers' own error lists every known type: 12 KB (tester-42 F7)


def test_a_full_out_disk_names_the_log_file():
    """A full ``--out`` disk ended the run with "[Errno 28] No space left on device", no path,
    exit 1 (tester-41 F4); the write of log.jsonl raises a TrainError (exit 2) naming it."""
    from zeroinf.cli.train import TrainError, _append_record
    log = open("/dev/full", "w")
    with pytest.raises(TrainError, match=r"--out: writing /x/log\.jsonl failed at step 7 \(No space left on device\)"):
        _append_record(log, Path("/x/log.jsonl"), {"step": 7, "loss": 1.0})
    with pytest.raises(OSError):  # the failed write's bytes are still buffered
        log.close()


def test_a_plot_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    """loss.png was written in place by matplotlib: a full --out disk ended in "[Errno 28] No space
    left on device" naming no file, exit 1, after summary.txt had listed loss.png as written
    (tester-45 F7). It goes through the rename writer, before the summary, and a failure names it."""
    import errno

    import zeroinf.cli.train as train_mod

    def full(path, write):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(train_mod, "write_then_rename", full)
    records = [{"step": 1, "loss": 2.0, "lr": 1e-3, "step_s": 1.0, "tokens_per_s": 1.0, "device_bytes": 0, "pinned_cpu_bytes": 0, "nvme_bytes": 0,
                "rss_bytes": 0}]
    with pytest.raises(train_mod.TrainError, match=r"--out: writing .*loss\.png failed \(No space left on device\)"):
        train_mod._Run._plot(records, tmp_path, title="t")
    assert not (tmp_path / "summary.txt").exists()


def test_a_full_out_disk_leaves_no_empty_summary(tmp_path, monkeypatch):
    """summary.json, summary.txt, run.json and compare.json are written through a temporary file
    and a rename: a full disk gave "[Errno 28]" with no path, exit 1, and an empty summary.json
    (tester-42 F3); it is a TrainError naming the file, and the old file (or none) stays."""
    import errno

    from zeroinf.cli.train import TrainError, _write_out
    target = tmp_path / "summary.json"
    _write_out(target, "old\n")

    import zeroinf.io.atomic

    class Full:  # the file is made and half written, then the disk is full
        def __init__(self, path, *args, **kwargs):
            self.f = open(path, "w")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[:2])
            raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(zeroinf.io.atomic, "open", Full, raising=False)
    with pytest.raises(TrainError, match=r"--out: writing .*summary\.json failed \(No space left on device\)"):
        _write_out(target, "new\n")
    monkeypatch.undo()
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_ctrl_c_during_compare_ends_with_one_line(tmp_path):
    """SIGINT while --compare replays the run: one line on stderr, exit 130, no traceback; the
    run's own outputs stay complete."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "zeroinf", "train", "--offload", "cpu", "--steps", "60", *TINY,
                             "--compare", "--no-plot", "--out", "o"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    summary = tmp_path / "o" / "summary.json"
    deadline = time.time() + 180
    while not summary.exists() and proc.poll() is None:
        assert time.time() < deadline, "the run did not finish its own steps in time"
        time.sleep(0.01)
    time.sleep(0.3)  # into the replay (about 60 x 20-70 ms)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "--compare interrupted after replaying" in err
    assert len(_log(tmp_path / "o")) == 60 and json.loads(summary.read_text())["steps"] == 60
