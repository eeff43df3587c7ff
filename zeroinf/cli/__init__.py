"""``zeroinf`` command line: one subcommand per tool, each in its own module.

Each entry of :data:`COMMANDS` names a module exposing ``add_arguments(parser)`` and
``main(args) -> int``. Modules are imported only when their subcommand runs, so
``zeroinf report`` works even when an unrelated tool's optional dependency is missing.
"""
from __future__ import annotations

import argparse
import errno
import fcntl
import importlib
import io
import os
import re
import sys
import threading
import warnings
from typing import List, Optional

#: subcommand -> (module, one-line help)
COMMANDS = {
    "train": ("zeroinf.cli.train", "train a transformer on real text with ZeRO-Infinity offload"),
    "report": ("zeroinf.cli.report", "show the torch version, CPU ISA paths, op and I/O backend states"),
    "estimate": ("zeroinf.cli.estimate", "memory per device/host/NVMe for DDP, ZeRO-1/2/3 and offload"),
    "plan": ("zeroinf.cli.plan", "choose the cheapest placement that fits and write its config"),
    "tune-io": ("zeroinf.cli.tune_io", "sweep aio block size / queue depth on a path, print the best block"),
}


#: seconds a subcommand's module may take to load (``import torch``, transformers) before a line
#: on stderr says what the wait is; on a busy 2-core machine it takes 10 s or more
LOADING_NOTICE_S = 2.0

#: exit code when the reader of stdout went away (``zeroinf plan | head -1``): 128 + SIGPIPE, the
#: status a shell reports for a tool that SIGPIPE ended
EXIT_BROKEN_PIPE = 141
#: exit code after Ctrl-C: 128 + SIGINT, as a shell reports for a tool that SIGINT ended
EXIT_INTERRUPTED = 130


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``zeroinf`` console script; returns the process exit code.

    When stdout is a pipe whose reader has gone, the command stops quietly with
    :data:`EXIT_BROKEN_PIPE` (not a BrokenPipeError traceback); files a
    subcommand finished writing before that are complete. A full or failing stdout (ENOSPC, EIO,
    EDQUOT) ends with one line on stderr and exit 1; a closed stdout or stderr is /dev/null.
    Ctrl-C that the subcommand does not handle itself (while torch is imported, during a progress
    bar) ends with one line on stderr and :data:`EXIT_INTERRUPTED`, not a traceback.
    """
    for name in ("stdout", "stderr"):  # started with it closed (>&-, 2>&-): every print raised
        if _closed(getattr(sys, name)):
            setattr(sys, name, open(os.devnull, "w"))
    try:
        try:
            return _run(argv)
        finally:  # output still buffered meets the broken pipe here, not at the interpreter's exit
            sys.stdout.flush()
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("zeroinf: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EIO, errno.EDQUOT):
            raise
        # a full or failing stdout (> /dev/full): one line, no traceback
        _drop_stdout()
        print(f"zeroinf: error: {exc}", file=sys.stderr)
        return 1


def _closed(stream) -> bool:
    """Whether ``stream`` cannot be written: missing (None: the interpreter found fd 1 closed at
    start), or on a descriptor that is closed or open read-only (with fd 2 closed, a launcher's
    script file can sit there: every write raised EBADF). Streams without a descriptor (pytest's
    capture) are open."""
    if stream is None:
        return True
    try:
        flags = fcntl.fcntl(stream.fileno(), fcntl.F_GETFL)
    except (io.UnsupportedOperation, ValueError):
        return False
    except OSError as exc:
        return exc.errno == errno.EBADF
    return flags & os.O_ACCMODE == os.O_RDONLY


def _drop_stdout() -> None:
    """Point stdout at /dev/null: its buffer still holds what could not be written, and the
    interpreter's final flush must not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose help output lets a BrokenPipeError through, as every other output
    of the command does (argparse drops it, so ``--help | head -1`` exited 0 or 141 by buffer size),
    and which takes any word starting with ``-`` and a digit as a value: argparse knows only plain
    negative numbers, so ``--cpu-mem -1GB`` or ``--lr -1e-3`` got "expected one argument" instead
    of the flag's own refusal. No option of zeroinf's starts with a digit."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def print_help(self, file=None):
        (file or sys.stdout).write(self.format_help())


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """zeroinf's own warnings (their text starts with "zeroinf") as their one line, without the
    library file, line and source that Python prints by default and that mean nothing to a user
    of the command; other libraries' warnings as Python formats them."""
    if str(message).startswith("zeroinf"):
        return f"{message}\n"
    return _python_format_warning(message, category, filename, lineno, line)


_python_format_warning = warnings.formatwarning


def _run(argv: Optional[List[str]]) -> int:
    warnings.formatwarning = _format_warning
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _Parser(prog="zeroinf", description="ZeRO-Infinity offload engine for PyTorch")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if argv and argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if not argv or argv[0] not in COMMANDS:
        # no subcommand is a usage error, as for git or pip: usage on stderr, status 2
        parser.print_help(sys.stderr)
        if argv:
            print(f"zeroinf: error: unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)})",
                  file=sys.stderr)
        return 2
    notice = threading.Timer(LOADING_NOTICE_S, print, (f"zeroinf {argv[0]}: loading torch ...",),
                             {"file": sys.stderr, "flush": True})
    notice.daemon = True
    notice.start()
    try:
        module = importlib.import_module(COMMANDS[argv[0]][0])
    finally:
        notice.cancel()
    cmd_parser = _Parser(prog=f"zeroinf {argv[0]}", description=COMMANDS[argv[0]][1])
    module.add_arguments(cmd_parser)
    args = cmd_parser.parse_args(argv[1:])
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
