"""``zeroinf train`` killed at any moment resumes: periodic atomic checkpoints, keep-last-K, Ctrl-C.

The runs are real subprocesses of a tiny model (seq 64, micro-batch 4, 12 steps). To kill one at
a chosen moment, the child runs :data:`_HOOKED`: ``zeroinf train`` with one function wrapped so
that the process, at that point, touches a marker file and sleeps until the test kills it.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from zeroinf.cli.train_checkpoints import (AUTO_SAVE_SHARE, CheckpointDir, RunState, SaveClock, SaveEvery, SaveKind,
                                       parse_save_every, read_run_state)

TINY = ["--offload", "infinity", "--size", "tiny", "--seq-len", "64", "--micro-batch", "4", "--seed", "0",
        "--steps", "12", "--no-plot"]

#: ``zeroinf train`` with a hang at $HOOK: "log:N" after step N's record is logged; "saving:TAG"
#: after the first file of TAG's save is written into TAG.saving; "latest:TAG" once TAG is complete
#: on disk, before ``latest`` names it. The hang lasts until $HOOK_MARK.release exists
_HOOKED = r"""
import os, sys, time
from pathlib import Path
import zeroinf.checkpoint.saveload as ck, zeroinf.cli.train as train, zeroinf.cli.train_checkpoints as tc
where, arg = os.environ["HOOK"].split(":")
def hang():
    mark = Path(os.environ["HOOK_MARK"])
    mark.touch()
    deadline = time.monotonic() + 600
    while not mark.with_suffix(".release").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
if where == "log":
    orig_log = train._append_record
    def _append_record(log, path, rec):
        orig_log(log, path, rec)
        if rec["step"] == int(arg):
            hang()
    train._append_record = _append_record
elif where == "saving":
    orig_save = ck.save_atomically
    def save_atomically(obj, path):
        orig_save(obj, path)
        if os.sep + arg + ".saving" + os.sep in path:
            hang()
    ck.save_atomically = save_atomically
else:
    orig_write = tc.write_durably
    def write_durably(path, text):
        if text == arg:
            hang()
        orig_write(path, text)
    tc.write_durably = write_durably
from zeroinf.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _env():
    root = str(Path(__file__).resolve().parents[1])
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))


def _train(args, cwd, check=True):
    proc = subprocess.run([sys.executable, "-m", "zeroinf", "train", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=240)
    if check and proc.returncode != 0:
        raise AssertionError(f"zeroinf train {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def _hang_at(hook, args, cwd):
    """Start ``zeroinf train ARGS`` that hangs at ``hook`` (see :data:`_HOOKED`); return it once there."""
    mark = Path(cwd) / "hook-reached"
    mark.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", _HOOKED, "train", *args], cwd=cwd,
                            env={**_env(), "HOOK": hook, "HOOK_MARK": str(mark)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while not mark.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {hook}:\n{proc.stderr.read()[-3000:]}")
        assert time.time() < deadline, f"the run did not reach {hook} in time"
        time.sleep(0.02)
    return proc


def _kill(proc):
    proc.kill()                              # SIGKILL: no handler, no clean-up
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def _log(out):
    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]


def _entries(out):
    return sorted(p.name for p in (Path(out) / "checkpoint").iterdir())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's 12 losses (no periodic checkpoint)."""
    cwd = tmp_path_factory.mktemp("reference")
    _train([*TINY, "--save-every", "0", "--out", "ref"], cwd)
    losses = [r["loss"] for r in _log(cwd / "ref")]
    assert len(losses) == 12
    return losses


def _same_losses(out, reference):
    log = _log(out)
    assert [r["step"] for r in log] == list(range(1, 13))   # replayed steps are not logged twice
    np.testing.assert_array_equal([r["loss"] for r in log], reference)


def test_sigkill_after_a_checkpoint_resumes_the_uninterrupted_losses(reference, tmp_path):
    """Killed after step 7 (checkpoints after steps 2, 4, 6; the newest 2 kept): the resumed run
    starts after step 6, runs step 7 again and ends with the uninterrupted run's losses."""
    proc = _hang_at("log:7", [*TINY, "--save-every", "2", "--keep-checkpoints", "2", "--out", "cut"], tmp_path)
    # a --resume of the run still going would clear its unfinished save: refused
    busy = _train(["--resume", "cut"], tmp_path, check=False)
    assert busy.returncode == 2 and "another zeroinf train is running there" in busy.stderr, busy.stderr
    _kill(proc)
    assert len(_log(tmp_path / "cut")) == 7
    assert _entries(tmp_path / "cut") == ["latest", "step4", "step6"]
    assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step6"
    assert read_run_state(json.loads((tmp_path / "cut" / "run.json").read_text())) is RunState.RUNNING
    # a fresh run there would mix its log with the checkpoint: refused
    bad = _train([*TINY, "--out", "cut"], tmp_path, check=False)
    assert bad.returncode == 2 and "holds an interrupted run" in bad.stderr, bad.stderr
    done = _train(["--resume", "cut"], tmp_path)
    assert "resumed after step 6" in done.stdout, done.stdout
    _same_losses(tmp_path / "cut", reference)
    # completed: the checkpoints went, and the run is no longer resumable
    assert not (tmp_path / "cut" / "checkpoint").exists()
    assert json.loads((tmp_path / "cut" / "run.json").read_text())["state"] == "completed"
    more = _train(["--resume", "cut", "--steps", "20"], tmp_path, check=False)
    assert more.returncode == 2 and "the run completed its 12 steps" in more.stderr, more.stderr


@pytest.mark.parametrize("hook", ["saving:step6", "latest:step6"])
def test_a_kill_inside_a_save_leaves_the_previous_checkpoint(hook, reference, tmp_path):
    """Killed while step 6's files are being written (step6.saving), or once they are complete
    but before ``latest`` names them: ``latest`` still names step 3, which the resume takes."""
    _kill(_hang_at(hook, [*TINY, "--save-every", "3", "--out", "cut"], tmp_path))
    left = "step6.saving" if hook.startswith("saving") else "step6"
    assert _entries(tmp_path / "cut") == ["latest", "step3", left]
    assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step3"
    done = _train(["--resume", "cut", "--steps", "7"], tmp_path, check=False)
    assert done.returncode == 0 and "resumed after step 3" in done.stdout, done.stderr
    np.testing.assert_array_equal([r["loss"] for r in _log(tmp_path / "cut")], reference[:7])


def test_a_run_killed_before_its_first_checkpoint_starts_over(reference, tmp_path):
    """--save-every 0 and a kill after step 2: run.json is there, no checkpoint; --resume runs the
    run's settings from step 1 (the log's two steps are not kept twice)."""
    _kill(_hang_at("log:2", [*TINY, "--save-every", "0", "--out", "cut"], tmp_path))
    assert not (tmp_path / "cut" / "checkpoint").exists() and len(_log(tmp_path / "cut")) == 2
    done = _train(["--resume", "cut"], tmp_path)
    assert "saved no checkpoint before it stopped; starting over from step 1" in done.stdout, done.stdout
    _same_losses(tmp_path / "cut", reference)


def test_ctrl_c_saves_and_says_one_line(tmp_path):
    """SIGINT while step 5 is being logged: the run finishes that step, saves it, prints one line
    (no traceback) and exits 130; ``latest`` names step 5."""
    proc = _hang_at("log:5", [*TINY, "--save-every", "0", "--out", "cut"], tmp_path)
    proc.send_signal(signal.SIGINT)                # what Ctrl-C sends
    time.sleep(0.5)                                # the handler runs, in the main thread, in the hang
    (tmp_path / "hook-reached.release").touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    lines = out.splitlines()
    assert len(lines) == 2 and lines[1] == (f"zeroinf train: interrupted after step 5; checkpoint in "
                                            f"{tmp_path / 'cut' / 'checkpoint' / 'step5'}; continue with: "
                                            f"zeroinf train --resume {tmp_path / 'cut'}"), out
    assert "Traceback" not in err
    assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step5"
    assert json.loads((tmp_path / "cut" / "run.json").read_text())["state"] == "interrupted"


@pytest.mark.parametrize("text,want", [
    ("auto", SaveEvery(SaveKind.AUTO)), ("0", SaveEvery(SaveKind.OFF)), ("off", SaveEvery(SaveKind.OFF)),
    ("25", SaveEvery(SaveKind.STEPS, 25)), ("10m", SaveEvery(SaveKind.SECONDS, 600.0)),
    ("1.5m", SaveEvery(SaveKind.SECONDS, 90.0)), ("90s", SaveEvery(SaveKind.SECONDS, 90.0)),
])
def test_save_every_forms(text, want):
    assert parse_save_every(text) == want


@pytest.mark.parametrize("text", ["-1", "10h", "0m", "m", "ten", ""])
def test_save_every_refuses_other_text(text):
    with pytest.raises(argparse.ArgumentTypeError, match="give a number of steps"):
        parse_save_every(text)


def test_save_clock():
    steps = SaveClock(parse_save_every("3"), first_step=5, now=0.0)        # resumed after step 4
    assert [s for s in range(5, 12) if steps.due(s, now=0.0)] == [7, 8, 9, 10, 11]
    steps.saved(7, 1.0, now=0.0)
    assert not steps.due(9, now=0.0) and steps.due(10, now=0.0)
    minutes = SaveClock(parse_save_every("1m"), first_step=1, now=100.0)
    assert not minutes.due(50, now=159.0) and minutes.due(1, now=160.0)
    auto = SaveClock(parse_save_every("auto"), first_step=1, now=0.0)
    assert auto.due(1, now=0.0)                                             # no save cost known yet
    auto.saved(1, 2.0, now=10.0)                                            # a save of 2 s ended at t=10
    wait = 2.0 * (1 / AUTO_SAVE_SHARE - 1)                                  # 38 s of training per 2 s saving
    assert not auto.due(2, now=10.0 + wait - 0.1) and auto.due(2, now=10.0 + wait)
    assert not SaveClock(parse_save_every("0"), 1).due(10**6)


class _FakeEngine:
    """save_checkpoint as the engine lays it out: TAG.saving written, renamed onto TAG."""

    def __init__(self):
        self.saves = []

    def save_checkpoint(self, save_dir, tag, save_latest=True):
        assert save_latest is False               # latest is CheckpointDir's to write, after the sync
        work = Path(save_dir) / (tag + ".saving")
        work.mkdir()
        (work / "model_states.pt").write_bytes(tag.encode())
        work.rename(Path(save_dir) / tag)
        self.saves.append(tag)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_checkpoints_keep_the_newest_k(tmp_path, keep):
    d = CheckpointDir(tmp_path / "checkpoint")
    assert d.newest_complete() is None
    engine = _FakeEngine()
    for step in (2, 4, 6, 8):
        assert d.save(engine, step, keep) >= 0
        assert d.newest_complete() == (f"step{step}", step)
    want = [f"step{s}" for s in (2, 4, 6, 8)][-keep:]
    assert _entries(tmp_path) == sorted(["latest", *want])
    assert (tmp_path / "checkpoint" / "step8" / "model_states.pt").read_bytes() == b"step8"


def test_clear_partial_keeps_what_latest_covers(tmp_path):
    root = tmp_path / "checkpoint"
    d = CheckpointDir(root)
    d.save(_FakeEngine(), 3, keep=2)
    d.save(_FakeEngine(), 6, keep=2)
    (root / "step9.saving").mkdir()                          # killed while writing step 9
    (root / "step12").mkdir()                                # killed before latest named step 12
    (root / "latest.tmp4242").write_text("step12")           # killed while writing latest
    (root / "notes.txt").write_text("mine")                  # not the layout's: stays
    assert sorted(p.name for p in d.clear_partial(6)) == ["latest.tmp4242", "step12", "step9.saving"]
    assert _entries(tmp_path) == ["latest", "notes.txt", "step3", "step6"]
    assert sorted(p.name for p in d.clear_partial(None)) == ["step3", "step6"]   # a fresh run: nothing covered
    (root / "latest").write_text("step5")
    with pytest.raises(ValueError, match="names 'step5', which is no step<N> folder there"):
        d.newest_complete()
    d.drop_all()
    assert _entries(tmp_path) == ["notes.txt"]


def test_run_json_states():
    assert read_run_state({"state": "running"}) is RunState.RUNNING
    assert read_run_state({"interrupted": True}) is RunState.INTERRUPTED     # written before "state"
    assert read_run_state({"interrupted": False}) is RunState.COMPLETED
    with pytest.raises(ValueError):
        read_run_state({"state": "paused"})
