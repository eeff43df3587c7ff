"""A ``zeroinf train`` worker under torchrun stops when its launcher is killed outright
(``stop_with_launcher``): a launcher (a plain parent process here) starts a worker that asks for
it, the launcher is SIGKILLed, and the worker must receive SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")

WORKER = textwrap.dedent("""
    import signal, sys, time
    from zeroinf.cli.train_setup import stop_with_launcher
    got = []
    signal.signal(signal.SIGTERM, lambda *a: got.append(1))
    if {ask} and not stop_with_launcher():
        print("not set", flush=True); sys.exit(3)
    print("ready", flush=True)
    end = time.time() + ({wait})
    while not got and time.time() < end:
        time.sleep(0.05)
    open(sys.argv[1], "w").write("sigterm" if got else "orphan")
""")

LAUNCHER = textwrap.dedent("""
    import subprocess, sys
    w = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
    assert w.stdout.readline().strip() == "ready"
    print(w.pid, flush=True)
    w.wait()
""")


def _launch_and_kill(tmp_path, ask: bool) -> str:
    out = tmp_path / f"worker_{ask}.txt"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WORKER.format(ask=ask, wait=20 if ask else 3), str(out)],
                                stdout=subprocess.PIPE, text=True)
    worker_pid = int(launcher.stdout.readline())
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=10)
    end = time.time() + 25
    while not out.exists() and time.time() < end:
        time.sleep(0.05)
    if not out.exists():  # never leave the orphan behind
        os.kill(worker_pid, signal.SIGKILL)
        pytest.fail("the worker wrote nothing within 25 s")
    time.sleep(0.1)
    return out.read_text()


def test_a_worker_gets_sigterm_when_its_launcher_is_killed(tmp_path):
    assert _launch_and_kill(tmp_path, ask=True) == "sigterm"


def test_without_it_the_worker_is_orphaned(tmp_path):
    # the reference: the same worker without the request runs on after the launcher's death
    assert _launch_and_kill(tmp_path, ask=False) == "orphan"
