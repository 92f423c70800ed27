"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") for ``lion``.

Per parameter, with gradient ``g`` and momentum ``m`` (zero at the start)::

    p <- p * (1 - lr * weight_decay)                      # decoupled weight decay
    p <- p - lr * sign(beta1 * m + (1 - beta1) * g)
    m <- beta2 * m + (1 - beta2) * g

Every coordinate moves by exactly ``lr`` per step (the sign), so Lion wants a learning rate
several times smaller than AdamW's and a weight decay as many times larger, keeping their
product, and so the strength of the decay, about the same. It keeps one state tensor per
parameter, half of AdamW's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from forge_lm.optim.param_groups import weight_decay_groups


class Lion(torch.optim.Optimizer):
    """Lion with decoupled weight decay; state per parameter: ``exp_avg`` (the momentum ``m``)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), decay = group["lr"], group["betas"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                momentum = state["exp_avg"]
                if decay != 0:
                    param.mul_(1.0 - lr * decay)
                # The update interpolates with beta1, the stored momentum with beta2: Lion's two
                # betas play different roles, unlike Adam's.
                update = torch.lerp(momentum, grad, 1.0 - beta1).sign_()
                param.add_(update, alpha=-lr)
                momentum.lerp_(grad, 1.0 - beta2)
        return loss


def build_lion(options: Any, model: nn.Module) -> Lion:
    groups = weight_decay_groups(model, options.weight_decay, options.decay_embeddings)
    return Lion(groups, lr=options.lr, betas=tuple(options.betas), weight_decay=options.weight_decay)
