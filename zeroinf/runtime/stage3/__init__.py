"""ZeRO stage 3: parameters partitioned over ranks and tiers, gathered just in time."""
from .manager import Stage3ParameterManager
from .options import Stage3ConfigError, Stage3Options

__all__ = ["Stage3ParameterManager", "Stage3Options", "Stage3ConfigError"]
