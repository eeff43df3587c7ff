"""Byte sizes on the command line: one parser for every tool.

Decimal units are powers of 1000 and binary units powers of 1024, as in the SI/IEC standards and
in what disks and ``df -H`` print: ``1G`` = ``1GB`` = 10**9 bytes, ``1GiB`` = ``1Gi`` = 2**30
bytes (likewise K, M, T, P). A bare number is bytes. Case does not matter.
"""
from __future__ import annotations

import math
import re
from typing import Union

__all__ = ["parse_bytes", "format_bytes", "SIZE_HELP"]

#: one line for ``--help`` texts
SIZE_HELP = "bytes; 1G = 1GB = 1e9, 1GiB = 2**30 (also K, M, T, P)"

_MULT = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _MULT[_p] = _MULT[_p + "b"] = 1000 ** _i
    _MULT[_p + "i"] = _MULT[_p + "ib"] = 1024 ** _i

_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: Union[str, int]) -> int:
    """Bytes from ``"1G"`` (10**9), ``"1GiB"`` (2**30), ``"256KiB"``, ``"1.5M"``, ``"4096"`` or an int.

    The value is rounded to a whole number of bytes.

    Raises:
        ValueError: not a non-negative number with one of the units above; the message gives
            examples.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _RE.fullmatch(str(text))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _MULT:
            raise ValueError(f"size {text!r}: expected a number of bytes with an optional unit, such as 4096, "
                             f"256KiB (2**18), 1G or 1GB (1e9), 1GiB (2**30)")
        value = float(m.group(1)) * _MULT[unit]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"size {text!r}: must be non-negative")
    return int(round(value))


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it exactly (``"256KiB"``, ``"1GiB"``),
    else in decimal (``"1G"``), else a bare number; :func:`parse_bytes` reads it back."""
    for unit, mult in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % mult == 0:
            return f"{n // mult}{unit}"
    for unit, mult in (("P", 10**15), ("T", 10**12), ("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if n and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)
