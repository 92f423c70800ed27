"""Token-to-expert routers (the ``routers`` category) and the losses they report.

The router call contract, defined by this plugin (the core leaves it to the MoE layer):

- Factory: ``factory(options, dim, n_experts, top_k) -> torch.nn.Module``.
- Call: ``router(x)`` with ``x`` the layer input ``[batch, seq, dim]``; returns a
  :class:`Routing`: ``indices`` ``LongTensor[batch * seq, top_k]`` (the chosen experts of each
  token, tokens in row-major ``(batch, seq)`` order, choices in priority order: column 0 is a
  token's first choice), ``weights`` ``[batch * seq, top_k]`` (float32 combine weights,
  differentiable with respect to the router's parameters) and ``aux_losses``
  (``{short name: scalar}``, each loss already multiplied by its weight, exactly once; the MoE
  layer reports them through :func:`forge_lm.losses.aux.report_aux_loss` without scaling).
- Optional methods: ``init_weights(init)`` (``init`` a :class:`forge_lm.components.Initializer`;
  called by the layer's ``init_weights``; it must set every parameter and buffer of the router,
  e.g. ``init.normal(self.weight, init.std)``, ``init.zeros(self.bias_buffer)``; without it every
  ``nn.Linear`` in the router is drawn from ``normal(0, init.std)``, biases 0) and
  ``after_optimizer_step()`` (called by forge-moe's ``forge_lm_step_end`` hook after every
  optimizer step, for no-gradient updates such as the sigmoid router's balancing bias) and
  ``step_skipped()`` (called by forge-moe's ``forge_lm_step_skipped`` hook when a step with a
  non-finite loss or gradient is skipped or rolled back: discard what the forwards since the
  last optimizer step accumulated, so the next update sees only the batches trained on).

Both built-in routers compute their logits in float32 with autocast off: routing decisions
are sensitive to rounding, and the router is a tiny part of the layer's cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from forge_moe.experts import count_per_expert

if TYPE_CHECKING:
    from forge_lm.components import Initializer


class Routing(NamedTuple):
    """What a router returns; see the module docstring for the contract."""

    indices: torch.Tensor  # [tokens, top_k] int64
    weights: torch.Tensor  # [tokens, top_k] float32
    aux_losses: dict[str, torch.Tensor]  # short name -> weighted scalar


def recomputing() -> bool:
    """Whether this forward is activation checkpointing's replay during backward (autograd is
    running a backward pass): a counter updated in forward must not count the batch twice.
    Inside ``torch.compile`` the replay is part of the compiled backward and runs no Python."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


# -- losses: formulas shared by the routers and written to be checked by hand -------------------


def expert_fractions(indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``f_i``: the fraction of the ``tokens * top_k`` assignments in ``indices`` that go to
    expert ``i`` (``[..., tokens, top_k]`` -> ``[..., n_experts]``; sums to 1; no gradient)."""
    one_hot = F.one_hot(indices, n_experts).to(torch.float32)  # [..., T, k, E]
    return one_hot.sum(dim=(-3, -2)) / (indices.shape[-2] * indices.shape[-1])


def switch_balance_loss(probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Switch Transformer balance loss ``E * sum_i f_i * P_i`` over all tokens.

    ``probs`` ``[tokens, E]``: the router's softmax; ``P_i`` is its mean over tokens. ``f_i`` is
    :func:`expert_fractions` of ``indices`` (the assignments before capacity dropping). 1.0 when
    routing is uniform, ``E`` when every token goes to one expert; gradient flows through ``P``.
    """
    n_experts = probs.shape[-1]
    return n_experts * (expert_fractions(indices, n_experts) * probs.mean(dim=0)).sum()


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (unweighted), per sequence then averaged.

    ``scores`` ``[batch, seq, E]`` (sigmoid affinities), ``indices`` ``[batch, seq, k]``. For each
    sequence: ``f_i = E / (k * T) * #{t: i chosen for t}``, ``P_i = mean_t s_it / sum_j s_jt``, and
    the sequence's loss is ``sum_i f_i * P_i``; the result is the mean over the batch's
    sequences (1.0 when every sequence spreads its tokens evenly).
    """
    n_experts = scores.shape[-1]
    f = n_experts * expert_fractions(indices, n_experts)  # [batch, E]
    p = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=1)  # [batch, E]
    return (f * p).sum(dim=-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss (unweighted): ``mean_t logsumexp(logits_t)^2``."""
    return torch.logsumexp(logits, dim=-1).square().mean()


# -- routers ------------------------------------------------------------------------------------


def _fp32_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.float(), weight.float())


class SoftmaxTopKRouter(nn.Module):
    """Softmax over the experts, top-k, weights renormalised over the chosen ones (Mixtral)."""

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        *,
        balance_loss_weight: float = 0.01,
        z_loss_weight: float = 0.0,
        renormalize: bool = True,
    ) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.balance_loss_weight, self.z_loss_weight, self.renormalize = balance_loss_weight, z_loss_weight, renormalize
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        nn.init.normal_(self.weight, mean=0.0, std=0.02)  # standalone default; a model's build calls init_weights

    def init_weights(self, init: Initializer) -> None:
        init.normal(self.weight, init.std)

    def forward(self, x: torch.Tensor) -> Routing:
        logits = _fp32_logits(x.reshape(-1, x.shape[-1]), self.weight)  # [T, E]
        probs = logits.softmax(dim=-1)
        top, indices = probs.topk(self.top_k, dim=-1)  # [T, k], descending
        weights = top / top.sum(dim=-1, keepdim=True) if self.renormalize else top
        losses = {}
        if self.balance_loss_weight:
            losses["balance_loss"] = self.balance_loss_weight * switch_balance_loss(probs, indices)
        if self.z_loss_weight:
            losses["z_loss"] = self.z_loss_weight * router_z_loss(logits)
        return Routing(indices, weights, losses)


class SigmoidTopKRouter(nn.Module):
    """DeepSeek-V3 routing: sigmoid affinities, experts chosen by ``score + bias``, combine weights
    from the unbiased scores normalised over the chosen experts.

    ``expert_bias`` is a buffer (saved in checkpoints, never given a gradient). In training mode
    each forward adds its per-expert assignment counts to ``pending_load``;
    :meth:`after_optimizer_step` then moves the bias by ``bias_update_rate * sign(mean load - load)``
    (underloaded experts up, overloaded down) and clears the counts, so a step with gradient
    accumulation updates once from all of its micro-batches. A skipped step
    (:meth:`step_skipped`) clears the counts without an update.
    """

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        *,
        bias_update_rate: float = 1e-3,
        sequence_balance_loss_weight: float = 0.0,
        z_loss_weight: float = 0.0,
    ) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.bias_update_rate = bias_update_rate
        self.sequence_balance_loss_weight, self.z_loss_weight = sequence_balance_loss_weight, z_loss_weight
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        self.register_buffer("pending_load", torch.zeros(n_experts, dtype=torch.float32), persistent=False)
        nn.init.normal_(self.weight, mean=0.0, std=0.02)  # standalone default; a model's build calls init_weights

    def init_weights(self, init: Initializer) -> None:
        init.normal(self.weight, init.std)
        init.zeros(self.expert_bias)  # buffers too: after a meta build they hold whatever to_empty left
        init.zeros(self.pending_load)

    def forward(self, x: torch.Tensor) -> Routing:
        batch_shape = x.shape[:-1]
        logits = _fp32_logits(x.reshape(-1, x.shape[-1]), self.weight)  # [T, E]
        scores = logits.sigmoid()
        with torch.no_grad():
            indices = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices  # the bias only selects
        chosen = scores.gather(-1, indices)  # unbiased affinities of the chosen experts
        weights = chosen / chosen.sum(dim=-1, keepdim=True)
        if self.training and not recomputing():
            with torch.no_grad():
                self.pending_load += count_per_expert(indices.reshape(-1), self.n_experts).float()
        losses = {}
        if self.sequence_balance_loss_weight:
            per_sequence = sequence_balance_loss(
                scores.reshape(*batch_shape, self.n_experts), indices.reshape(*batch_shape, self.top_k)
            )
            losses["seq_balance_loss"] = self.sequence_balance_loss_weight * per_sequence
        if self.z_loss_weight:
            losses["z_loss"] = self.z_loss_weight * router_z_loss(logits)
        return Routing(indices, weights, losses)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Apply the pending bias update: ``bias += rate * sign(mean(load) - load)``; clear the load."""
        load = self.pending_load  # no tokens since the last step: every sign is 0, the bias stays
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        load.zero_()

    @torch.no_grad()
    def step_skipped(self) -> None:
        """The step these counts belong to was abandoned (a non-finite loss): drop them, bias unchanged."""
        self.pending_load.zero_()


# -- factories (options classes in forge_moe.plugin) --------------------------------------------


def build_softmax_topk(options, dim: int, n_experts: int, top_k: int) -> SoftmaxTopKRouter:
    return SoftmaxTopKRouter(
        dim,
        n_experts,
        top_k,
        balance_loss_weight=options.balance_loss_weight,
        z_loss_weight=options.z_loss_weight,
        renormalize=options.renormalize,
    )


def build_sigmoid_topk(options, dim: int, n_experts: int, top_k: int) -> SigmoidTopKRouter:
    return SigmoidTopKRouter(
        dim,
        n_experts,
        top_k,
        bias_update_rate=options.bias_update_rate,
        sequence_balance_loss_weight=options.sequence_balance_loss_weight,
        z_loss_weight=options.z_loss_weight,
    )
