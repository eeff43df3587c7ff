"""Checkpoints that must not load, or be written, are refused with a message naming why: another
layout, parameters in other flat positions, another precision, files of two saves in one folder,
a client_state that load could not read back, tags that would break the folder."""
import os
import shutil

import pytest
import torch

import zeroinf
from zeroinf.checkpoint import CheckpointError
from checkpoint_helpers import _small_engine


def test_load_refuses_another_layout_and_incomplete_saves(tmp_path):
    engine, _ = _small_engine()
    engine.save_checkpoint(str(tmp_path), "a")
    other, _ = _small_engine(sub_group_size=60)
    with pytest.raises(CheckpointError, match=r"the first that differs.*saved \['g0/s0', 50, 0\], here "
                       r"\['g0/s0', 60, 0\].*consolidate\(\)"):
        other.load_checkpoint(str(tmp_path), "a")
    os.unlink(tmp_path / "a" / "model_states.pt")  # as if rank 0 died before the last write
    with pytest.raises(CheckpointError, match="model_states.pt: missing"):
        engine.load_checkpoint(str(tmp_path), "a")
    with pytest.raises(CheckpointError, match="a/latest"):  # a folder without 'latest' and a tag it lacks
        engine.load_checkpoint(str(tmp_path / "a"), "latest")


class _UpDown(torch.nn.Module):
    def __init__(self, down_first=False):
        super().__init__()
        for name in (("down", "up") if down_first else ("up", "down")):
            setattr(self, name, torch.nn.Linear(8, 8))

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class _TwoBlocks(torch.nn.Module):
    def __init__(self, down_first=False):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_UpDown(down_first) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("change", ["model_parameters", "registration"])
def test_load_refuses_parameters_in_other_flat_positions(tmp_path, stage, change):
    """The masters and Adam moments are restored by flat position, the module by name: the same
    model with model_parameters in another order (param groups built from a set), or with its
    layers registered in another order (inside a stage-3 unit too), loaded silently and every
    weight was ~0.4 off after one step (helper-40, /tmp/tester24/f04*.py). It is refused."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(0)
    model = _TwoBlocks()
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    engine.backward(engine(torch.ones(2, 8)).square().mean())
    engine.step()
    engine.save_checkpoint(str(tmp_path), "t")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    engine.close()
    other = _TwoBlocks(down_first=change == "registration")
    params = list(other.parameters())[::-1] if change == "model_parameters" else None
    engine, *_ = zeroinf.initialize(model=other, model_parameters=params, config=cfg)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    if stage == 3 and change == "model_parameters":  # stage 3 lays out by module, whatever the order given
        engine.load_checkpoint(str(tmp_path), "t")
        assert all(torch.equal(v, saved[k]) for k, v in other.state_dict().items())
        engine.close()
        return
    with pytest.raises(CheckpointError, match=r"parameter group 0 is laid out differently: position 0 holds "
                                              r"'blocks\.0\.up\.weight' \[8, 8\] at element 0 in the checkpoint, "
                                              r"'blocks\.\d\.(down|up)\.(weight|bias)' \[8(, 8)?\] at element 0 here"):
        engine.load_checkpoint(str(tmp_path), "t")
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())  # nothing loaded
    engine.close()


def test_a_client_state_load_could_not_read_is_refused_at_save(tmp_path):
    """client_state={"args": argparse.Namespace(...)} (or a numpy scalar) saved "successfully" into
    a checkpoint that load_checkpoint (weights_only) and consolidate could never read (helper-40,
    /tmp/tester24/f02). The save refuses it, naming the key, and writes nothing; a class allowed
    with torch.serialization's safe globals is saved and comes back."""
    import argparse

    import numpy as np

    engine, _ = _small_engine()
    engine.backward(engine(torch.randn(4, 7)).square().mean())
    engine.step()
    for bad, typ in (({"args": argparse.Namespace(lr=0.1), "step": 3}, "argparse.Namespace"),
                     ({"step": 3, "args": np.float64(0.5)}, "numpy.float64")):
        with pytest.raises(TypeError, match=rf"client_state\['args'\] \({typ}\) could not be read back"):
            engine.save_checkpoint(str(tmp_path), "t", client_state=bad)
        assert not os.listdir(tmp_path)
    with torch.serialization.safe_globals([argparse.Namespace]):
        engine.save_checkpoint(str(tmp_path), "t", client_state={"args": argparse.Namespace(lr=0.1)})
        _, got = engine.load_checkpoint(str(tmp_path), "t")
    assert got == {"args": argparse.Namespace(lr=0.1)}


def test_a_stage_3_checkpoint_in_another_precision_is_refused_naming_it(tmp_path):
    """bf16 -> fp32 at stage 3 was refused as 'saved with 3 optimizer sub-groups, this engine has
    3', blaming the model or sub_group_size (helper-40 f03); the message names the precisions."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "bf16": {"enabled": True}}
    engine, *_ = zeroinf.initialize(model=_TwoBlocks(), config=cfg)
    engine.save_checkpoint(str(tmp_path), "t")
    engine.close()
    del cfg["bf16"]
    engine, *_ = zeroinf.initialize(model=_TwoBlocks(), config=cfg)
    with pytest.raises(CheckpointError, match=r"saved training in bf16, this engine trains in fp32.*consolidate\(\)"):
        engine.load_checkpoint(str(tmp_path), "t")
    engine.close()


def test_files_of_two_saves_in_one_folder_are_refused(tmp_path):
    """Every per-file check passed when an optimizer file of an earlier save was copied into a
    later save's folder (a partial restore): the masters jumped back (helper-40 f11). Each file
    carries the save's id; a renamed folder still loads."""
    engine, _ = _small_engine()
    x = torch.randn(4, 7)
    for tag in ("early", "late"):
        engine.backward(engine(x).square().mean())
        engine.step()
        engine.save_checkpoint(str(tmp_path), tag)
    os.rename(tmp_path / "late", tmp_path / "renamed")
    engine.load_checkpoint(str(tmp_path), "renamed")
    name = sorted(f for f in os.listdir(tmp_path / "early") if f.startswith("optim_"))[0]
    shutil.copy(tmp_path / "early" / name, tmp_path / "renamed" / name)
    with pytest.raises(CheckpointError, match=rf"{name}: written by another save \('early@steps=1,.*'\) than "
                                              r"model_states.pt \('late@steps=2,.*'\); the folder mixes"):
        engine.load_checkpoint(str(tmp_path), "renamed")
    # consolidate and the partial loads read the same files (they took them silently: tester-45 F3)
    for load in (lambda: zeroinf.checkpoint.consolidate(str(tmp_path), "renamed", str(tmp_path / "c.pt")),
                 lambda: engine.load_checkpoint(str(tmp_path), "renamed", load_module_only=True),
                 lambda: engine.load_checkpoint(str(tmp_path), "renamed", load_optimizer_states=False)):
        with pytest.raises(CheckpointError, match=rf"{name}: written by another save .* the folder mixes"):
            load()


@pytest.mark.parametrize("tag", ["latest", "latest.tmp", "x.saving", "x.old", "a/b", ".."])
def test_tags_that_would_break_the_folder_are_refused(tmp_path, tag):
    """A checkpoint tagged 'latest' became a folder where the 'latest' file goes, and every later
    save failed (found by the tester)."""
    engine, _ = _small_engine()
    with pytest.raises(ValueError, match="checkpoint tag"):
        engine.save_checkpoint(str(tmp_path), tag)
    assert os.listdir(tmp_path) == []
