"""Progress for waits whose length the program cannot count in steps (a compiler run, a file
being filled by the kernel): a tqdm bar that advances with wall-clock time while the wait lasts.

The bar is drawn only where tqdm draws by default (a terminal on stderr); elsewhere the caller's
own one-line message is the whole trace, so logs are not filled with redraws.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator, Optional


@contextlib.contextmanager
def ticking(desc: str, expected_s: Optional[float] = None, interval_s: float = 0.5) -> Iterator[None]:
    """Show elapsed seconds (and the share of ``expected_s``, a typical duration in seconds, when
    given) on stderr while the body runs; the bar is closed however the body ends."""
    from tqdm import tqdm

    total = float(expected_s) if expected_s else None
    bar = tqdm(total=total, desc=desc, unit="s", file=sys.stderr, disable=None, leave=False,
               bar_format="{desc}: {elapsed}" + (" (usually ~{total:.0f} s) {bar}" if total else ""))
    done = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not done.wait(interval_s):
            elapsed = time.monotonic() - start
            bar.n = min(elapsed, total) if total else elapsed
            bar.refresh()

    ticker = threading.Thread(target=tick, name="zeroinf-progress", daemon=True)
    if not bar.disable:
        ticker.start()
    try:
        yield
    finally:
        done.set()
        if ticker.is_alive():
            ticker.join()
        bar.close()
