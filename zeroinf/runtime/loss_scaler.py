"""Loss scaling for fp16 training, with DeepSpeed's semantics (``deepspeed/runtime/fp16/loss_scaler.py``,
``DynamicLossScaler.update_scale`` as of 0.19.8).

Dynamic scaling: start at ``2**initial_scale_power``. On a step whose gradients hold inf/nan the
step is skipped; once ``hysteresis`` such overflows have accumulated the scale is divided by 2
(never below ``min_loss_scale``; an overflow that would lower it while it already is at
``min_loss_scale`` raises, as DeepSpeed's does: skipping steps there would go on for ever). The
scale doubles after every ``loss_scale_window`` clean steps in a row: when the number of clean
steps since the last overflow (or since the start, counting from -1), minus one, is a positive
multiple of the window; the hysteresis budget is refilled then. With ``consecutive_hysteresis``
the budget is refilled after every clean step.
"""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["LossScaler"]


class LossScaler:
    """Static (``loss_scale > 0``) or dynamic (``loss_scale == 0``) loss scale.

    Args mirror :class:`zeroinf.config.FP16Config`. ``scale`` is a float (power of two for the
    dynamic scaler, so scaling and unscaling are exact in floating point).
    """

    def __init__(self, loss_scale: float = 0.0, initial_scale_power: int = 16, loss_scale_window: int = 1000,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False, min_loss_scale: float = 1.0):
        self.dynamic = loss_scale == 0.0
        self.scale = float(2.0 ** initial_scale_power) if self.dynamic else float(loss_scale)
        self.window = int(loss_scale_window)
        self.delayed_shift = int(hysteresis)
        self.cur_hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_scale = float(min_loss_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @classmethod
    def from_config(cls, fp16) -> "LossScaler":
        """Build from a :class:`zeroinf.config.FP16Config`."""
        return cls(fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis,
                   fp16.consecutive_hysteresis, fp16.min_loss_scale)

    def update(self, overflow: bool) -> None:
        """Account for one optimizer-step boundary; ``overflow`` says whether it was skipped.

        Raises:
            FloatingPointError: an overflow with the scale at ``min_loss_scale`` and no
                hysteresis left (the state is left as it was).
        """
        if self.dynamic:
            if overflow:
                if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                    if self.scale == self.min_scale:
                        raise FloatingPointError(
                            f"fp16: the gradients overflowed with the loss scale already at fp16.min_loss_scale "
                            f"({self.min_scale:g}), so it cannot be lowered and every step would be skipped (DeepSpeed "
                            "stops here too); the run has diverged: lower the lr, clip gradients, or train in bf16. "
                            "The step was skipped and counted: to go on anyway, carry on with the next micro-batch")
                    self.scale = max(self.scale / 2.0, self.min_scale)
                else:
                    self.cur_hysteresis -= 1
                self.last_overflow_iter = self.cur_iter
            else:
                if self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                stable = self.cur_iter - self.last_overflow_iter - 1
                if stable > 0 and stable % self.window == 0:
                    if not self.consecutive_hysteresis:
                        self.cur_hysteresis = self.delayed_shift
                    self.scale *= 2.0
        self.cur_iter += 1

    def state_dict(self) -> Dict[str, Any]:
        """Plain ints/floats/bools (loads with ``torch.load(weights_only=True)``)."""
        return {"dynamic": self.dynamic, "scale": self.scale, "cur_hysteresis": self.cur_hysteresis,
                "cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the config's window/hysteresis stay)."""
        self.scale = float(sd["scale"])
        self.cur_hysteresis = int(sd["cur_hysteresis"])
        self.cur_iter = int(sd["cur_iter"])
        self.last_overflow_iter = int(sd["last_overflow_iter"])
