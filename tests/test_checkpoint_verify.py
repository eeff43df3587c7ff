"""Checkpoint files are verified at load: a flipped, truncated or missing file of the latest
checkpoint raises one CheckpointError line naming it, the engine keeps its state, and the
previous checkpoint still loads exactly (stage 3, parameters and optimizer on NVMe)."""
import os

import pytest
import torch

from zeroinf.checkpoint import CheckpointError
from checkpoint_helpers import _engine_state, _stage3_nvme_engine, _train


def _flip_middle(path: str) -> None:
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x10
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize("fault", ["flip", "truncate", "delete"])
def test_a_bad_file_of_the_last_checkpoint_is_named_and_the_previous_one_loads(tmp_path, fault):
    (tmp_path / "nv").mkdir()
    engine = _stage3_nvme_engine(tmp_path / "nv")
    _train(engine, 1)
    engine.save_checkpoint(str(tmp_path / "ck"), "a")
    saved_a = _engine_state(engine)
    _train(engine, 1, seed=5)
    last = engine.save_checkpoint(str(tmp_path / "ck"), "b")
    _train(engine, 1, seed=9)
    before = _engine_state(engine)
    name = sorted(f for f in os.listdir(last) if f.startswith("optim_rank0_"))[0]
    path = os.path.join(last, name)
    if fault == "flip":
        _flip_middle(path)
    elif fault == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        os.remove(path)
    with pytest.raises(CheckpointError) as info:
        engine.load_checkpoint(str(tmp_path / "ck"), "b")
    assert name in str(info.value) and "\n" not in str(info.value)
    after = _engine_state(engine)
    assert all(torch.equal(after[0][k], before[0][k]) for k in before[0])
    assert all(torch.equal(a, b) for x, y in zip(after[1], before[1]) for a, b in zip(x, y))
    engine.load_checkpoint(str(tmp_path / "ck"), "a")
    got = _engine_state(engine)
    assert all(torch.equal(got[0][k], saved_a[0][k]) for k in saved_a[0])
    assert all(torch.equal(a, b) for x, y in zip(got[1], saved_a[1]) for a, b in zip(x, y))
    assert got[2] == saved_a[2]
    engine.close()
