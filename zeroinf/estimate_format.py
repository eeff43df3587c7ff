"""Numbers in and out of the memory model: parameter counts and byte sizes parsed from the command
line, and counts and sizes formatted (decimal GB, 10**9 bytes, or binary GiB, 2**30)."""
from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Union

from zeroinf.sizes import parse_bytes as _parse_bytes

__all__ = ["GB", "GiB", "parse_count", "parse_bytes", "format_count", "format_size"]

GB = 10**9
GiB = 2**30

_SUFFIX_COUNT = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: Union[str, int, float]) -> int:
    """A parameter count from ``7e9``, ``7B``, ``6.7b``, ``350M``, ``1.2T`` or an int.

    Suffixes are decimal: K = 1e3, M = 1e6, B (or G) = 1e9, T = 1e12. The number is read exactly
    (as a decimal, so ``1.1B`` is 1,100,000,000) and must be whole: a fraction of a parameter means
    nothing (``1.5`` was rounded to 2).

    Raises:
        ValueError: not a positive whole number with an optional suffix.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not math.isfinite(text):
            raise ValueError(f"parameter count {text!r}: must be at least 1")
        value = Decimal(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
        if not m:
            raise ValueError(f"parameter count {text!r}: expected a number such as 7e9, 7B or 350M")
        value = Decimal(m.group(1)) * _SUFFIX_COUNT[m.group(2).lower()]
    if value < 1:
        raise ValueError(f"parameter count {text!r}: must be at least 1")
    if value != value.to_integral_value():
        raise ValueError(f"parameter count {text!r}: {value.normalize():f} is not a whole number of parameters")
    return int(value)


def parse_bytes(text: Union[str, int]) -> int:
    """Bytes from ``80GB`` or ``80G`` (decimal, 1e9), ``80GiB`` (binary, 2**30), ``1TB``,
    ``512MiB`` or a plain number of bytes: :func:`zeroinf.sizes.parse_bytes`, the parser of every
    tool.

    Raises:
        ValueError: not a non-negative number with one of those units.
    """
    return _parse_bytes(text)


def format_count(n: int) -> str:
    """``n`` with thousands separators (``7,000,000,000``)."""
    return f"{n:,}"


def format_size(nbytes: int, unit: str = "GB") -> str:
    """``nbytes`` in ``unit`` (``"GB"`` = 1e9 or ``"GiB"`` = 2**30 bytes), without the unit: two
    decimals from 1 up, three significant digits below (so small models do not print 0.00),
    always positional (2000 bytes: ``0.000002``, not ``2e-06``)."""
    v = nbytes / (GB if unit == "GB" else GiB)
    if v >= 1 or v == 0:
        return f"{v:,.2f}"
    return f"{v:.{2 - math.floor(math.log10(v))}f}".rstrip("0").rstrip(".")
