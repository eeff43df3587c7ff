"""Shared by the ``zeroinf train`` tests (test_train_*.py): the offload and tiny-model arguments, a
run as a real subprocess (``python -m zeroinf train``) to its end or until it has logged some
steps, and its log.jsonl."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path


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
