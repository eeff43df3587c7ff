"""DeepSpeed's LR schedules (``deepspeed/runtime/lr_schedules.py``, as of 0.19.8): WarmupLR,
WarmupDecayLR, WarmupCosineLR, with the same formulas and the same convention: at construction
``last_batch_iteration`` is -1 and the groups' lr is set to that iteration's value (WarmupLR and
WarmupDecayLR: ``warmup_min_lr``; WarmupCosineLR: 0), and the schedule is stepped once after each
optimizer step. So the first two optimizer steps both run at the warm-up's start, as in DeepSpeed.

Warm-up factor ``gamma(t)`` for ``0 <= t < warmup_num_steps`` (``W``, raised to at least 2):
``log(t + 1) / log(W)`` ("log") or ``t / W`` ("linear"); 1 after.

* WarmupLR: ``lr = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma(t)``;
  ``warmup_max_lr`` defaults to each param group's lr at construction.
* WarmupDecayLR: as WarmupLR (``warmup_max_lr`` defaults to 1e-3, as in DeepSpeed), and after
  warm-up ``gamma = max(0, (T - t) / max(1, T - W))``.
* WarmupCosineLR: ``lr = base_lr * ratio``; during warm-up ``ratio = warmup_min_ratio +
  (1 - warmup_min_ratio) * gamma(t)``, after it ``ratio = max(0, cos_min_ratio + (1 - cos_min_ratio)
  * (1 + cos(pi * min(1, (t - W + 1) / max(1, T - W)))) / 2)`` (the progress clamped at 1: past
  ``total_num_steps`` the lr stays at ``cos_min_ratio``), where ``base_lr`` is each param group's lr
  at construction.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "build_scheduler"]


class WarmupLR:
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` (default: each group's lr) over
    ``warmup_num_steps``, then hold.

    Raises:
        ValueError: ``warmup_num_steps`` is not a positive int, or ``warmup_type`` is neither
            "log" nor "linear".
    """

    def __init__(self, optimizer, warmup_min_lr: float = 0.0, warmup_max_lr: Optional[float] = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log"):
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.optimizer = optimizer
        self.min_lrs = [warmup_min_lr] * len(optimizer.param_groups)
        self.max_lrs = ([g["lr"] for g in optimizer.param_groups] if warmup_max_lr is None
                        else [warmup_max_lr] * len(optimizer.param_groups))
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = -1
        self._apply()

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            if self.warmup_type == "log":
                return self.inverse_log_warm_up * math.log(t + 1)
            return t / self.warmup_num_steps
        return 1.0

    def get_lr(self) -> List[float]:
        """The lr of each param group for the current iteration (``warmup_min_lr`` before the first step)."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        g = self._gamma()
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def get_last_lr(self) -> List[float]:
        """The lrs last written into the param groups."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration (or jump to ``last_batch_iteration``) and set the groups' lr."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self._apply()

    def _apply(self) -> None:
        """Write the current iteration's lr into the param groups."""
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr

    def state_dict(self) -> Dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.last_batch_iteration = int(sd["last_batch_iteration"])
        self._apply()


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: Optional[float] = 1e-3, warmup_num_steps: int = 1000, warmup_type: str = "log"):
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, 1e-3 if warmup_max_lr is None else warmup_max_lr,
                         warmup_num_steps, warmup_type)

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return super()._gamma()
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(WarmupLR):
    """Warm-up of the ratio to 1, then cosine decay to ``cos_min_ratio`` at ``total_num_steps``;
    the lr is the ratio times each group's lr at construction."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 1e-4, warmup_type: str = "log"):
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.org_lrs = [g["lr"] for g in optimizer.param_groups]
        super().__init__(optimizer, 0.0, 1.0, warmup_num_steps, warmup_type)

    def get_lr(self) -> List[float]:
        t = self.last_batch_iteration
        if t < 0:
            return [0.0] * len(self.org_lrs)
        if t < self.warmup_num_steps:
            ratio = self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * self._gamma()
        else:
            real_t = t - self.warmup_num_steps + 1
            real_total = max(1, self.total_num_steps - self.warmup_num_steps)
            ratio = (1.0 + math.cos(math.pi * min(1.0, real_t / real_total))) / 2.0
            ratio = max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)
        return [lr * ratio for lr in self.org_lrs]

    def state_dict(self) -> Dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration, "org_lrs": list(self.org_lrs)}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """The saved position and base lrs; a state saved by another schedule (WarmupLR: a run
        resumed with a new schedule, which DeepSpeed allows) has no base lrs, and
        this schedule keeps its own, the optimizer's lr at initialize."""
        self.org_lrs = [float(x) for x in sd.get("org_lrs", self.org_lrs)]
        super().load_state_dict(sd)


def build_scheduler(cfg, optimizer):
    """Instantiate the schedule a :class:`zeroinf.config.SchedulerConfig` names over ``optimizer``."""
    if cfg.type == "WarmupLR":
        return WarmupLR(optimizer, cfg.warmup_min_lr, cfg.warmup_max_lr, cfg.warmup_num_steps, cfg.warmup_type)
    if cfg.type == "WarmupDecayLR":
        return WarmupDecayLR(optimizer, cfg.total_num_steps, cfg.warmup_min_lr, cfg.warmup_max_lr,
                             cfg.warmup_num_steps, cfg.warmup_type)
    if cfg.type == "WarmupCosineLR":
        return WarmupCosineLR(optimizer, cfg.total_num_steps, cfg.warmup_min_ratio, cfg.warmup_num_steps,
                              cfg.cos_min_ratio, cfg.warmup_type)
    raise ValueError(f"scheduler.type: unknown schedule {cfg.type!r}")
