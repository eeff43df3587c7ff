"""Progress on stderr for the waits a user would otherwise sit through in silence.

* :func:`counting` — a tqdm bar over a loop of known length (swap files allocated, sub-groups
  written or read, checkpoint files), shown once the loop has run for ``delay_s`` seconds.
* :func:`ticking` — for waits the program cannot count in steps (a compiler run): a bar that
  advances with wall-clock time while the wait lasts.

Whether bars are drawn: ``ZEROINF_PROGRESS=1`` always (from the first item, also into a log
file), ``ZEROINF_PROGRESS=0`` never, unset where tqdm draws by default (stderr is a terminal);
elsewhere the caller's own one-line messages are the whole trace, so logs are not filled with
redraws. The variable is read at each call.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Iterable, Iterator, Optional, TypeVar

#: environment variable that forces bars on (1/true/yes/on) or off (0/false/no/off)
PROGRESS_ENV = "ZEROINF_PROGRESS"

T = TypeVar("T")


def forced() -> Optional[bool]:
    """``ZEROINF_PROGRESS`` as True (always draw), False (never) or None (unset or another value:
    draw on a terminal)."""
    value = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


def _bar_args(delay_s: float) -> dict:
    """tqdm's ``disable`` and ``delay`` (seconds) for :data:`PROGRESS_ENV`'s setting."""
    force = forced()
    return {"disable": None if force is None else not force, "delay": 0.0 if force else delay_s}


def counting(iterable: Iterable[T], desc: str, unit: str = "it", total: Optional[int] = None,
             delay_s: float = 1.0) -> Iterable[T]:
    """``iterable`` wrapped in a tqdm bar on stderr (``total``: its length where ``len()`` cannot
    tell). The bar appears once the loop has taken ``delay_s`` seconds, so a short loop prints
    nothing, and is cleared when the loop ends, however it ends."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, unit=unit, total=total, file=sys.stderr, leave=False, **_bar_args(delay_s))


def bar(desc: str, unit: str = "it", total: Optional[float] = None, delay_s: float = 1.0, **kwargs):
    """A tqdm bar on stderr that the caller advances with ``update(n)`` and must ``close()``
    (``unit_scale=True`` and ``unit="B"`` for bytes); drawn as :func:`counting` draws."""
    from tqdm import tqdm

    return tqdm(desc=desc, unit=unit, total=total, file=sys.stderr, leave=False, **_bar_args(delay_s), **kwargs)


@contextlib.contextmanager
def ticking(desc: str, expected_s: Optional[float] = None, interval_s: float = 0.5) -> Iterator[None]:
    """Show elapsed seconds (and the share of ``expected_s``, a typical duration in seconds, when
    given) on stderr while the body runs; the bar is closed however the body ends."""
    total = float(expected_s) if expected_s else None
    shown = bar(desc, unit="s", total=total, delay_s=0.0,
                bar_format="{desc}: {elapsed}" + (" (usually ~{total:.0f} s) {bar}" if total else ""))
    done = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not done.wait(interval_s):
            elapsed = time.monotonic() - start
            shown.n = min(elapsed, total) if total else elapsed
            shown.refresh()

    ticker = threading.Thread(target=tick, name="zeroinf-progress", daemon=True)
    if not shown.disable:
        ticker.start()
    try:
        yield
    finally:
        done.set()
        if ticker.is_alive():
            ticker.join()
        shown.close()
