"""Schedule-Free AdamW (Defazio et al. 2024, "The Road Less Scheduled") for ``schedule_free_adamw``.

The method keeps three points per parameter: ``z``, the plain AdamW iterate; ``x``, a
weighted running average of the ``z``; and ``y = (1 - beta1) * z + beta1 * x``, where the
gradient is taken. The paper's Algorithm 1, with steps ``t = 1, 2, ...``::

    v_t     = beta2 * v_{t-1} + (1 - beta2) * g_t**2               # g_t: gradient at y_t
    lr_t    = lr * sqrt(1 - beta2**t) * min(1, t / warmup_steps)
    z_{t+1} = z_t - lr_t * g_t / (sqrt(v_t) + eps) - lr_t * weight_decay * y_t
    c_{t+1} = lr_t**2 / (lr_1**2 + ... + lr_t**2)
    x_{t+1} = (1 - c_{t+1}) * x_t + c_{t+1} * z_{t+1}

The averaging replaces the learning-rate schedule: ``x`` is the point to evaluate and export,
and it is good at every step, so a run needs no decay phase and no total length in advance.
``lr`` is the group's learning rate, so a scheduler's warmup acts exactly as the optimizer's
own (both are ``(s + 1) / W`` on step ``s``); set one or the other, as the two multiply. Pair
it with the scheduler ``none`` (or ``constant``): a decaying schedule on top defeats the
purpose. The authors' implementation weights the average by the largest ``lr_t`` so far
rather than ``lr_t``; the two agree while the rate does not decrease, as with those schedulers.

Memory: only ``y`` (in the parameters) and ``z`` and ``v`` (in the state) are stored, as in
the authors' implementation; ``x`` is recovered from them when needed, since
``x = (y - (1 - beta1) * z) / beta1``. In ``y`` and ``z`` the averaging step reads
``y <- y + c * (z - y) + lr_t * (beta1 * (1 - c) - 1) * u`` with ``u`` the update direction
(normalised gradient plus weight decay) and ``z <- z - lr_t * u``.

Train and eval modes. The parameters hold ``y`` while training, which is not the point to
evaluate. Whoever drives the optimizer must call :meth:`ScheduleFreeAdamW.eval` before
evaluating, exporting or checkpointing the model (the parameters then hold ``x``) and
:meth:`ScheduleFreeAdamW.train` before the next :meth:`~ScheduleFreeAdamW.step`. Forge's
training loop does so for any optimizer that has ``train()`` and ``eval()`` methods. The
mode is part of the state dict, so a checkpoint written in eval mode (parameters at ``x``)
resumes correctly: load the model and optimizer states, then call ``train()``. ``step()``
in eval mode raises, since it would corrupt the iterates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from forge_lm.optim.param_groups import weight_decay_groups


class ScheduleFreeAdamW(torch.optim.Optimizer):
    """Schedule-Free AdamW; see the module docstring for the update and the train/eval modes.

    State per parameter: ``z`` and ``exp_avg_sq`` (``v``). Per group, plain numbers saved
    with the state dict: ``step`` (steps taken), ``lr_sq_sum`` (the sum of ``lr_t**2``, the
    denominator of the averaging weight) and ``train_mode``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
    ) -> None:
        if not 0.0 < betas[0] < 1.0:
            # x is recovered by dividing by beta1, and beta1 = 1 would never move y off x.
            raise ValueError(f"schedule-free AdamW needs 0 < beta1 < 1, got {betas[0]}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "warmup_steps": warmup_steps,
            "step": 0,
            "lr_sq_sum": 0.0,
            "train_mode": True,
        }
        super().__init__(params, defaults)

    # -- modes --------------------------------------------------------------------------------

    @torch.no_grad()
    def eval(self) -> None:
        """Put the averaged point ``x`` in the parameters (for evaluation and export)."""
        for group in self.param_groups:
            if group["train_mode"]:
                beta1 = group["betas"][0]
                for param in self._stepped(group):
                    param.lerp_(self.state[param]["z"], 1.0 - 1.0 / beta1)  # y -> x
                group["train_mode"] = False

    @torch.no_grad()
    def train(self) -> None:
        """Put the gradient point ``y`` back in the parameters (before the next step)."""
        for group in self.param_groups:
            if not group["train_mode"]:
                beta1 = group["betas"][0]
                for param in self._stepped(group):
                    param.lerp_(self.state[param]["z"], 1.0 - beta1)  # x -> y
                group["train_mode"] = True

    def _stepped(self, group: dict[str, Any]) -> list[torch.Tensor]:
        # A parameter that never had a gradient has no z, and x = y = z for it.
        return [param for param in group["params"] if "z" in self.state[param]]

    # -- the update ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if not all(group["train_mode"] for group in self.param_groups):
            raise RuntimeError(
                "ScheduleFreeAdamW.step() called in eval mode: the parameters hold the averaged "
                "point x. Call optimizer.train() after evaluating or checkpointing."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        t = group["step"] + 1
        warmup = group["warmup_steps"]
        lr_t = group["lr"] * math.sqrt(1.0 - beta2**t) * (min(1.0, t / warmup) if warmup > 0 else 1.0)
        lr_sq_sum = group["lr_sq_sum"] + lr_t**2
        average_weight = lr_t**2 / lr_sq_sum if lr_sq_sum > 0 else 0.0  # c_{t+1}
        y_coefficient = lr_t * (beta1 * (1.0 - average_weight) - 1.0)
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["z"] = param.detach().clone(memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            z, exp_avg_sq = state["z"], state["exp_avg_sq"]
            grad = param.grad
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            update = grad / exp_avg_sq.sqrt().add_(group["eps"])
            if group["weight_decay"] != 0:
                update.add_(param, alpha=group["weight_decay"])  # decay taken at y, as in the paper
            param.lerp_(z, average_weight)  # y uses the old z: this order is the algebra above
            param.add_(update, alpha=y_coefficient)
            z.sub_(update, alpha=lr_t)
        group["step"] = t
        group["lr_sq_sum"] = lr_sq_sum


def build_schedule_free_adamw(options: Any, model: nn.Module) -> ScheduleFreeAdamW:
    groups = weight_decay_groups(model, options.weight_decay, options.decay_embeddings)
    return ScheduleFreeAdamW(
        groups,
        lr=options.lr,
        betas=tuple(options.betas),
        eps=options.eps,
        weight_decay=options.weight_decay,
        warmup_steps=options.warmup_steps,
    )
