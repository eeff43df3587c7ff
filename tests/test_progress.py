"""zeroinf.progress.ticking: a time bar on a terminal, nothing elsewhere."""
import io
import sys
import time

import pytest

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
