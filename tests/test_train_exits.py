"""``zeroinf train`` refusing or failing ends in one line and a known exit status, leaving no empty
folder or summary behind: bad input, seed and out, a batch larger than the corpus, a diverged run,
logits that outgrow memory, a model config with no causal-LM class, a full out disk, a plot that
cannot be written, Ctrl-C during --compare."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from train_helpers import TINY, _log, _train


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
