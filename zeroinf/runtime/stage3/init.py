"""Placeholder until zeroinf.Init lands: no parameter is partitioned at construction."""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn


def init_shapes(module: nn.Module) -> Dict[nn.Parameter, torch.Size]:
    """Shapes of parameters partitioned at construction by ``zeroinf.Init`` (none yet)."""
    return {}


def take_init_values(param: nn.Parameter) -> torch.Tensor:
    raise KeyError("parameter was not created under zeroinf.Init")
