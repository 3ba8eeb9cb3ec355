"""Loss scaling for fp16 training (the ``"fp16"`` config section), with DeepSpeed's rules.

fp16 has 5 exponent bits: small gradients underflow to zero. The loss is multiplied by a scale
``S`` before backward, so gradients arrive multiplied by ``S``; the update divides them by ``S``
again (on the fp32 gradients, where nothing underflows). A scale that is too large overflows:
some gradient is inf or NaN. That step is then skipped (no parameter or optimizer state changes)
and, with dynamic scaling, the scale shrinks.

Dynamic scaling (``loss_scale: 0``), as DeepSpeed's ``DynamicLossScaler`` does it:

* start at ``2 ** initial_scale_power``;
* on an overflow, spend one unit of the ``hysteresis`` budget; once the budget is down to 1, halve
  the scale instead (never below ``min_loss_scale``), at every overflow until the budget is refilled;
* after ``loss_scale_window`` steps without overflow since the last one, double the scale (and,
  with ``consecutive_hysteresis``, refill the hysteresis budget after every good step).

A static scale (``loss_scale > 0``) never changes; an overflowing step is still skipped.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    """The loss scale of an fp16 run and how it evolves (see the module docstring)."""

    scale: float
    """The factor the loss is multiplied by before backward."""
    dynamic: bool = True
    """False: ``scale`` is static."""
    window: int = 1000
    """Good steps (since the last overflow) between doublings."""
    hysteresis: int = 2
    """Overflows tolerated before halving (the budget is refilled when the scale doubles)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every good step."""
    min_scale: float = 1.0
    """The dynamic scale never goes below this."""
    overflows: int = 0
    """Steps skipped because a gradient was inf or NaN."""

    def __post_init__(self) -> None:
        self._hysteresis_left = self.hysteresis
        self._good_steps = 0  # steps without overflow since the last overflow (or the start)

    @classmethod
    def from_config(cls, fp16) -> "LossScaler":
        """From the ``"fp16"`` section (:class:`zinf.config.FP16Config`)."""
        if fp16.loss_scale > 0:
            return cls(scale=float(fp16.loss_scale), dynamic=False)
        return cls(scale=float(2 ** fp16.initial_scale_power), dynamic=True, window=fp16.loss_scale_window,
                   hysteresis=fp16.hysteresis, consecutive_hysteresis=fp16.consecutive_hysteresis,
                   min_scale=float(fp16.min_loss_scale))

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step: ``overflow`` says whether it was skipped."""
        if overflow:
            self.overflows += 1
            self._good_steps = 0
            if not self.dynamic:
                return
            if self._hysteresis_left <= 1:  # the budget stays spent: the next overflow halves again
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self._hysteresis_left -= 1
            return
        self._good_steps += 1
        if not self.dynamic:
            return
        if self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis
        if self._good_steps % self.window == 0:
            self.scale *= 2
            self._hysteresis_left = self.hysteresis
