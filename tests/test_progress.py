"""zeroinf.progress.ticking: a time bar on a terminal, nothing elsewhere."""
import io
import sys
import time

import pytest
import torch

from zeroinf.progress import ticking


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_draws_elapsed_time_on_a_terminal(monkeypatch):
    err = _Tty()
    monkeypatch.setattr(sys, "stderr", err)
    with ticking("compiling op 'x'", expected_s=60, interval_s=0.02):
        time.sleep(0.15)
    text = err.getvalue()
    assert "compiling op 'x'" in text and "usually ~60 s" in text


def test_silent_when_stderr_is_not_a_terminal(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with ticking("waiting", interval_s=0.02):
        time.sleep(0.05)
    assert err.getvalue() == ""


def test_an_error_in_the_body_passes_through_and_stops_the_ticker(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Tty())
    with pytest.raises(ValueError, match="boom"):
        with ticking("waiting", interval_s=0.01):
            raise ValueError("boom")
    time.sleep(0.05)
    import threading
    assert not any(t.name == "zeroinf-progress" for t in threading.enumerate())


# ---------------------------------------------------------------------------- counting, bar, ZEROINF_PROGRESS
from zeroinf.progress import PROGRESS_ENV, bar, counting  # noqa: E402


def test_counting_yields_every_item_and_is_silent_off_a_terminal(monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert list(counting(range(5), "zeroinf: work", unit="file")) == [0, 1, 2, 3, 4]
    assert err.getvalue() == ""


def test_the_variable_forces_bars_on_into_a_file_and_off_on_a_terminal(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv(PROGRESS_ENV, "1")
    assert list(counting([1, 2, 3], "zeroinf: work", unit="file")) == [1, 2, 3]
    assert "zeroinf: work" in err.getvalue() and "/3" in err.getvalue()
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.setenv(PROGRESS_ENV, "0")
    list(counting([1, 2, 3], "zeroinf: work"))
    b = bar("zeroinf: bytes", unit="B", unit_scale=True)
    b.update(10)
    b.close()
    with ticking("waiting", interval_s=0.01):
        time.sleep(0.03)
    assert tty.getvalue() == ""


# ---------------------------------------------------------------------------- the waits that use them
def _stage3_nvme_config(nvme):
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {
                "stage": 3, "stage3_param_persistence_threshold": 20, "sub_group_size": 1500,
                "offload_param": {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 2,
                                  "buffer_size": 4096, "max_in_cpu": 0},
                "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 4}}}


def test_stage3_nvme_set_up_checkpoints_and_consolidate_show_progress(tmp_path, monkeypatch, capsys):
    """Every wait that grows with the model — building it under Init, allocating and filling
    the parameter swap files, writing the optimizer's (each allocated as it is first written),
    saving, checking and loading a checkpoint, consolidating — draws a bar on stderr; the
    consolidated weights are the engine's."""
    import zeroinf
    import zeroinf.checkpoint
    from stage3_models import TinyLM, batch, loss_fn

    monkeypatch.setenv(PROGRESS_ENV, "1")
    cfg = _stage3_nvme_config(tmp_path / "nvme")
    torch.manual_seed(0)
    with zeroinf.Init(config=cfg):
        model = TinyLM()
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    set_up = capsys.readouterr().err
    for desc in ("zeroinf.Init: moving parameters to NVMe", "zeroinf: allocating parameter swap files",
                 "zeroinf: partitioning parameters", "zeroinf: writing initial optimizer state"):
        assert desc in set_up, desc
    x, y = batch(0)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    assert "zeroinf: saving optimizer state" in capsys.readouterr().err
    engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
    loaded = capsys.readouterr().err
    assert "zeroinf: checking checkpoint files" in loaded and "zeroinf: loading optimizer state" in loaded
    sd = zeroinf.checkpoint.consolidate(str(tmp_path / "ckpt"), "t", str(tmp_path / "w.pt"))
    assert "zeroinf: consolidating" in capsys.readouterr().err
    with zeroinf.gathered_parameters(list(engine.module.parameters())):
        want = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    assert want.keys() <= sd.keys()
    for n, w in want.items():
        torch.testing.assert_close(sd[n], w, rtol=0, atol=0)
    engine.close()


def test_tune_io_sweep_shows_progress_and_measures_every_point(tmp_path, monkeypatch, capsys):
    from zeroinf.io.tune import sweep

    monkeypatch.setenv(PROGRESS_ENV, "1")
    rows = sweep(str(tmp_path), 65536, [4096, 16384], [1, 2], backend="python", repeat=1)
    assert [(r["block_size"], r["queue_depth"]) for r in rows] == [(4096, 1), (4096, 2), (16384, 1), (16384, 2)]
    assert "zeroinf tune-io: measuring" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # its scratch file is gone
