"""More experts from a trained MoE layer: ``[checkpoint.growth] experts = "copy"``.

Called by the core's growth (:class:`forge_lm.components.GrowsWeights`) when ``init_from``
weights fill a model whose MoE layers have more routed experts than the source's: new expert
``e`` is a copy of source expert ``e mod n`` (``n`` source experts) with Gaussian noise of
``expert_noise`` times the standard deviation of the weight it copies, and its router row (and
bias, for a router with one) is the copied expert's, so the copies are routed alike until they
drift apart. The source's experts keep their places, unchanged. Width differences left over
(the experts' hidden size) are the core's width rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from forge_lm.errors import ConfigError

EXPERT_WEIGHTS = ("experts.w1", "experts.w3", "experts.w2")  # [n_experts, ...]: experts first
ROUTER_ROWS = ("router.weight", "router.expert_bias")  # one row (value) per expert, where present


def grow_experts(
    source: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]], rules: Any, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """The source tensors of one MoE layer with the expert count ``shapes`` asks for (names
    relative to the layer); empty when the count is the source's."""
    if "experts.w1" not in source or "experts.w1" not in shapes:
        return {}
    have, want = source["experts.w1"].shape[0], shapes["experts.w1"][0]
    if want == have:
        return {}
    if want < have:
        raise ConfigError(
            f"[checkpoint] init_from: the source's MoE layers have {have} experts but [model.ffn] n_experts is {want}: "
            "growth only adds experts; set n_experts to at least the source's."
        )
    if rules.experts != "copy":
        raise ConfigError(
            f"[checkpoint] init_from: the source's MoE layers have {have} experts but [model.ffn] n_experts is {want}: "
            "set [checkpoint.growth] experts = 'copy' (new experts copy trained ones, with expert_noise), or set "
            f"n_experts = {have}."
        )
    copied = torch.arange(want) % have
    grown: dict[str, torch.Tensor] = {}
    for name in EXPERT_WEIGHTS:
        weight = source[name].float()
        values = weight[copied].clone()
        if rules.expert_noise:
            scale = weight.std(dim=tuple(range(1, weight.ndim)))[copied[have:]] * rules.expert_noise
            noise = torch.randn(values[have:].shape, generator=generator)
            values[have:] += noise * scale.view(-1, *[1] * (weight.ndim - 1))
        grown[name] = values
    for name in ROUTER_ROWS:
        if name in source:
            grown[name] = source[name][copied].clone()
    return grown
