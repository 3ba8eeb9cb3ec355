"""Optimizer updates on flat fp32 views, matching ``torch.optim`` operation for operation.

zinf keeps each shard's optimizer group (master weights and moments) in one flat tensor per
state, wherever its home is, and updates each member parameter through a view. The arithmetic
below is that of torch's single-tensor (``foreach=False``) implementations, which is what
``torch.optim.AdamW/Adam/SGD`` run for CPU tensors, so fp32 training on the CPU matches plain
PyTorch bit for bit. Each member keeps its own step count: a parameter that got no gradient in a
step is skipped, exactly as torch skips parameters whose ``.grad`` is None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class OptimizerSpec:
    """What to run, and which state tensors (besides the master) each shard needs."""

    type: str  # "AdamW", "Adam" or "SGD"
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    momentum: float
    dampening: float
    nesterov: bool
    amsgrad: bool
    fused: bool = False  # Adam/AdamW through torch's fused CPU kernel (zinf.fused_optimizer)

    @classmethod
    def from_config(cls, opt, fused: bool = False) -> "OptimizerSpec":
        p = opt.params
        return cls(opt.type, p.lr, tuple(p.betas), p.eps, p.weight_decay, p.momentum, p.dampening, p.nesterov, p.amsgrad,
                   fused=fused and opt.type in ("Adam", "AdamW"))

    @property
    def state_names(self) -> tuple[str, ...]:
        if self.type in ("Adam", "AdamW"):
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if self.amsgrad else ("exp_avg", "exp_avg_sq")
        return ("momentum",) if self.momentum != 0 else ()

    def update(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], step: int) -> None:
        """Update ``param`` in place. ``step`` is the member's step count *after* this update
        (1 on its first update); ``state`` holds views of its moments (zeros before step 1)."""
        if self.type == "SGD":
            self._sgd(param, grad, state, step)
        elif self.fused:
            self._fused_adam(param, grad, state, step)
        else:
            self._adam(param, grad, state, step)

    def _fused_adam(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], step: int) -> None:
        """torch's fused Adam/AdamW kernel (the functional API of ``torch.optim.Adam(fused=True)``),
        which increments the step tensor itself."""
        from torch.optim.adam import adam
        from torch.optim.adamw import adamw

        beta1, beta2 = self.betas
        (adamw if self.type == "AdamW" else adam)(
            [param], [grad], [state["exp_avg"]], [state["exp_avg_sq"]],
            [state["max_exp_avg_sq"]] if self.amsgrad else [], [torch.tensor(float(step - 1))],
            fused=True, amsgrad=self.amsgrad, beta1=beta1, beta2=beta2, lr=self.lr, weight_decay=self.weight_decay,
            eps=self.eps, maximize=False)

    def _adam(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], step: int) -> None:
        beta1, beta2 = self.betas
        lr, wd = self.lr, self.weight_decay
        if wd != 0:
            if self.type == "AdamW":
                param.mul_(1 - lr * wd)
            else:
                grad = grad.add(param, alpha=wd)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        # torch keeps the step as a float32 tensor and reads it back with .item()
        step_f = float(torch.tensor(float(step), dtype=torch.float32).item())
        bias_correction1 = 1 - beta1**step_f
        bias_correction2 = 1 - beta2**step_f
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        if self.amsgrad:
            max_sq = state["max_exp_avg_sq"]
            torch.maximum(max_sq, exp_avg_sq, out=max_sq)
            denom = (max_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)

    def _sgd(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], step: int) -> None:
        if self.weight_decay != 0:
            grad = grad.add(param, alpha=self.weight_decay)
        if self.momentum != 0:
            buf = state["momentum"]
            if step == 1:  # torch: buf = grad.clone() on the first step
                buf.copy_(grad)
            else:
                buf.mul_(self.momentum).add_(grad, alpha=1 - self.dampening)
            grad = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
        param.add_(grad, alpha=-self.lr)


def clip_coefficient(norms: list[Tensor], max_norm: float) -> Tensor:
    """torch.nn.utils.clip_grad_norm_'s coefficient from per-parameter 2-norms (model order)."""
    total_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    clip_coef = max_norm / (total_norm + 1e-6)
    return torch.clamp(clip_coef, max=1.0)
