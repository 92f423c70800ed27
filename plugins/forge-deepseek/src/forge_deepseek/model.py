"""The ``deepseek_v3`` model family: Forge's transformer trunk with MLA and MoE blocks, plus
multi-token prediction modules (:mod:`forge_deepseek.mtp`).

The trunk is the core's :class:`~forge_lm.model.transformer.Transformer` (embedding, pre-norm
blocks, final norm, untied head), so FSDP2, activation checkpointing, compile, initialisation on
the meta device, generation and the memory estimate treat it as any Forge model. Its blocks'
attention is the ``[model.attention]`` component (``mla``) and their feed-forward layer
forge-moe's ``moe`` with the MoE layers from ``n_dense_layers`` on.

The MTP modules run only inside a training step (a :func:`forge_lm.losses.aux.collect_aux`
collector, in training mode): their loss is reported as ``mtp_loss`` through
:func:`~forge_lm.losses.aux.report_aux_loss`, so the loop adds it to the backpropagated loss
and logs it under its own name, while the logits (and so ``loss``) are the main trunk's alone.
Evaluation, generation and export run the trunk only.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn

from forge_deepseek.mla import MultiHeadLatentAttention
from forge_deepseek.mtp import MTPModule, mtp_targets, shifted, token_cross_entropy
from forge_lm.api import (
    Block,
    KVCache,
    Transformer,
    attention_mask,
    attention_spec,
    build_layers,
    collecting_aux,
    compute_dtype,
    report_aux_loss,
    report_metric,
)
from forge_lm.errors import ForgeError


class DeepseekV3(Transformer):
    """``forward(input_ids, document_ids=None, kv_cache=None, positions=None) -> logits`` of the
    main trunk; in a training step also the MTP loss, reported (see the module docstring)."""

    def __init__(
        self,
        config: Any,
        vocab_size: int,
        feed_forwards: list[nn.Module],
        attentions: list[nn.Module],
        mtp: list[MTPModule],
    ) -> None:
        super().__init__(config, vocab_size, feed_forwards, attentions)
        self.mtp = nn.ModuleList(mtp)

    def init_weights(self, init: Any) -> None:
        super().init_weights(init)
        for module in self.mtp:
            module.init_weights(init)

    def keep_stage(self, stage: int, stages: int) -> None:
        if len(self.mtp):
            raise ForgeError(
                f"[distributed] pp = {stages} cannot split a deepseek_v3 model with [model] mtp_depth = "
                f"{len(self.mtp)}: its MTP modules need the embedding (first stage) and the head (last stage) "
                "together. Set mtp_depth = 0, or pp = 1."
            )
        super().keep_stage(stage, stages)

    def flops_per_token(self, seq_len: int) -> float:
        """``6 * active parameters``, plus the output head once more per MTP depth (it is shared,
        so counted once among the parameters but multiplied ``1 + mtp_depth`` times), plus the
        attention products of every block, the MTP blocks' included: ``6 * H * (d_qk + d_v) * T``
        per block (scores and weighted sum, forward and backward; no causal halving, as the core)."""
        from forge_lm.api import active_parameter_count

        flops = 6.0 * active_parameter_count(self)
        flops += 6.0 * len(self.mtp) * self.config.dim * self.vocab_size
        blocks = [*self.blocks(), *(module.block for module in self.mtp)]
        for block in blocks:
            attention = block.attention
            if isinstance(attention, MultiHeadLatentAttention):
                width = attention.qk_nope_head_dim + attention.qk_rope_head_dim + attention.v_head_dim
                flops += 6.0 * attention.n_heads * width * seq_len
            else:
                flops += 12.0 * self.config.dim * seq_len
        return flops

    def forward(
        self,
        input_ids: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self._predicts_ahead(kv_cache, positions):
            return super().forward(input_ids, document_ids, kv_cache, positions)

        # The MTP modules start from the trunk's last hidden state before its final norm, which
        # the trunk's forward does not return: they run on the final norm's input, from a hook.
        # Running them there, before the head, also orders their backward after the head's:
        # under FSDP2 the root unit's parameters (head, embedding, MTP modules) are gathered again
        # by a hook on the logits, which the MTP loss (reported aside) does not pass through.
        def predict_ahead(_norm: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            report_aux_loss("mtp_loss", self.mtp_loss(args[0], input_ids, document_ids))

        handle = self.norm.register_forward_pre_hook(predict_ahead)
        try:
            return super().forward(input_ids, document_ids)
        finally:
            handle.remove()

    def _predicts_ahead(self, kv_cache: KVCache | None, positions: torch.Tensor | None) -> bool:
        """Whether this forward computes the MTP loss: a training step with MTP modules, over
        whole sequences (no cache, no context-parallel slice)."""
        if not len(self.mtp) or not self.training or not collecting_aux():
            return False
        return kv_cache is None and positions is None and self.output is not None and self.tok_embeddings is not None

    def mtp_loss(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, document_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """``mtp_loss_weight * mean_k CE_k``: depth ``k`` predicts ``t[i + k + 1]`` at position ``i``
        from the previous depth's hidden state there and the embedding of ``t[i + k]``.
        Each depth's unweighted cross-entropy is logged as ``mtp/depth<k>_loss``."""
        seq, device = input_ids.shape[1], input_ids.device
        mask, is_causal = attention_mask(
            document_ids, 0, seq, device, self.config.attention_backend, compute_dtype(device)
        )
        cos, sin = self.rope(0, seq)
        embeddings = self.tok_embeddings(input_ids)  # [B, T, dim]
        losses = []
        for k, module in enumerate(self.mtp, start=1):
            hidden = module(hidden, shifted(embeddings, k), cos, sin, mask, is_causal)
            logits = self.output(module.norm(hidden))  # [B, T, vocab], the shared head
            losses.append(token_cross_entropy(logits, mtp_targets(input_ids, document_ids, k + 1)))
            report_metric(f"mtp/depth{k}_loss", losses[-1].detach())
        return self.config.mtp_loss_weight * torch.stack(losses).mean()


def placed_feed_forward(options: Any, registry: Any) -> Any:
    """``[model.ffn]`` with forge-moe's MoE layers placed as DeepSeek-V3 does: every block from
    ``n_dense_layers`` on (and so every MTP block). Another feed-forward is left as it is."""
    from forge_moe.options import MoEOptions

    chosen = options.ffn
    ffn_options = chosen.options
    if ffn_options is None:
        component = chosen.component if chosen.component is not None else registry.resolve("feed_forwards", chosen.name)
        ffn_options = component.options_class()
    if not isinstance(ffn_options, MoEOptions):
        return chosen
    placed = attrs.evolve(ffn_options, first_moe_layer=options.n_dense_layers, every_n_layers=1)
    return attrs.evolve(chosen, options=placed)


def build_deepseek_v3(options: Any, context: Any) -> DeepseekV3:
    """Factory of the ``deepseek_v3`` family (options: ``forge_deepseek.options.DeepseekV3Options``).

    Blocks ``0 .. n_layers - 1`` form the trunk; the attention and feed-forward layers of indices
    ``n_layers .. n_layers + mtp_depth - 1`` go to the MTP modules' blocks (MoE, as in DeepSeek-V3)."""
    total = options.n_layers + options.mtp_depth
    ffn = placed_feed_forward(options, context.registry)
    feed_forwards = build_layers(ffn, context.registry, "feed_forwards", options.dim, total)
    attentions = build_layers(options.attention, context.registry, "attentions", attention_spec(options), total)
    n = options.n_layers
    mtp = [
        MTPModule(options.dim, options.norm_eps, Block(options, n + k, feed_forwards[n + k], attentions[n + k]))
        for k in range(options.mtp_depth)
    ]
    return DeepseekV3(options, context.vocab_size, feed_forwards[:n], attentions[:n], mtp)
