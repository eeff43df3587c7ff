"""Typed readers of one config block's values: each takes the block dict, the key and the block's
path, checks the type and range, and raises :class:`ConfigError` naming the key path."""
from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config value is invalid, unknown or not supported; ``key_path`` names it (dotted)."""

    def __init__(self, key_path: str, message: str):
        self.key_path = key_path
        super().__init__(f"{key_path}: {message}" if key_path else message)


_MISSING = object()


def _path(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _int(block: Mapping, key: str, prefix: str, default: Any, *, min_value: Optional[int] = None,
         max_value: Optional[int] = None) -> Any:
    v = block.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    # JSON writers emit 5e8 for 500000000; accept floats with no fractional part, as DeepSpeed does.
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and (not math.isfinite(v) or v != int(v))):
        raise ConfigError(_path(prefix, key), f"expected an integer, got {v!r}")
    v = int(v)
    if min_value is not None and v < min_value:
        raise ConfigError(_path(prefix, key), f"must be >= {min_value}, got {v}")
    if max_value is not None and v > max_value:
        raise ConfigError(_path(prefix, key), f"must be <= {max_value}, got {v}")
    return v


def _float(block: Mapping, key: str, prefix: str, default: Any, *, min_value: Optional[float] = None,
           max_value: Optional[float] = None, allow_inf: bool = False) -> Any:
    v = block.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if allow_inf and isinstance(v, str) and v.lower() in ("inf", "infinity"):
        return math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (not allow_inf and not math.isfinite(v)):
        raise ConfigError(_path(prefix, key), f"expected a number, got {v!r}")
    if min_value is not None and v < min_value:
        raise ConfigError(_path(prefix, key), f"must be >= {min_value}, got {v}")
    if max_value is not None and v > max_value:
        raise ConfigError(_path(prefix, key), f"must be <= {max_value}, got {v}")
    return float(v)


def _bool(block: Mapping, key: str, prefix: str, default: bool) -> bool:
    v = block.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(_path(prefix, key), f"expected true or false, got {v!r}")
    return v


def _choice(block: Mapping, key: str, prefix: str, default: str, allowed: Tuple[str, ...]) -> str:
    v = block.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, str) or v.lower() not in allowed:
        raise ConfigError(_path(prefix, key), f"expected one of {', '.join(allowed)}, got {v!r}")
    return v.lower()


def _block(config: Mapping, key: str, prefix: str) -> Dict[str, Any]:
    v = config.get(key, _MISSING)
    if v is _MISSING or v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ConfigError(_path(prefix, key), f"expected an object (dict), got {type(v).__name__}")
    return dict(v)

