"""The weight renaming every Hugging Face decoder of Forge's shape shares: Llama, Qwen3 and the
MoE formats (through forge-moe) rename embeddings, attention (QK-norm included), norms, head and
the per-layer prefixes here, and pass a function for their own feed-forward weights."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

from forge_lm.errors import ForgeError

# Forge name <-> HF name of what every decoder of Forge's shape shares: outside the blocks,
# and inside block N (after the prefixes "layers.N." and "model.layers.N.").
_GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",  # QK-norm (Qwen3)
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_FORGE_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_IGNORED = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")  # old checkpoints kept it

FeedForwardRenamer = Callable[[int, str, torch.Tensor], dict[str, torch.Tensor] | None]
"""``(block index, name inside the block, tensor) -> {name inside the block on the other side:
tensor}``, or None for a name the format does not know. It may return several tensors (one
stacked Forge tensor is one HF tensor per expert, and back) or none yet (it keeps the pieces
and the caller assembles them after the renaming)."""


def rename_to_hf(
    state: Mapping[str, torch.Tensor], feed_forward: FeedForwardRenamer, *, architecture: str
) -> dict[str, torch.Tensor]:
    """``state`` (a Forge state dict) under the Hugging Face names of ``architecture``
    (``"LlamaForCausalLM"``, for messages): the shared parts renamed here, each block's other
    weights (its feed-forward) by ``feed_forward``. Tensors are passed on, not copied; a name
    that neither knows is refused."""
    return _rename(
        state,
        feed_forward,
        (_GLOBAL_NAMES, _BLOCK_NAMES, _FORGE_LAYER, "model.layers"),
        lambda name: f"parameter '{name}' has no Hugging Face {architecture} counterpart.",
    )


def rename_from_hf(
    state: Mapping[str, torch.Tensor], feed_forward: FeedForwardRenamer, *, architecture: str
) -> dict[str, torch.Tensor]:
    """A Hugging Face ``architecture`` state dict under Forge's names: the inverse of
    :func:`rename_to_hf`. RoPE's cached ``inv_freq`` (kept by old checkpoints) is skipped.

    Without ``lm_head.weight`` (tied checkpoints omit it) the head is the embedding tensor,
    which loads correctly into tied and untied Forge models alike.
    """
    out = _rename(
        {name: tensor for name, tensor in state.items() if not _HF_IGNORED.fullmatch(name)},
        feed_forward,
        (_FORGE_GLOBAL_NAMES, _FORGE_BLOCK_NAMES, _HF_LAYER, "layers"),
        lambda name: f"weight '{name}' is not part of a {architecture} that Forge can import.",
    )
    if "tok_embeddings.weight" not in out:
        raise ForgeError(f"the checkpoint has no model.embed_tokens.weight; it is not a complete {architecture}.")
    out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


_FORGE_GLOBAL_NAMES = {hf: forge for forge, hf in _GLOBAL_NAMES.items()}
_FORGE_BLOCK_NAMES = {hf: forge for forge, hf in _BLOCK_NAMES.items()}


def _rename(
    state: Mapping[str, torch.Tensor],
    feed_forward: FeedForwardRenamer,
    names: tuple[dict[str, str], dict[str, str], re.Pattern[str], str],
    refusal: Callable[[str], str],
) -> dict[str, torch.Tensor]:
    """One direction of the renaming; ``names`` is (outside the blocks, inside a block, the
    pattern of a block's name with its index, the other side's block prefix)."""
    global_names, block_names, layer, prefix = names
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in global_names:
            out[global_names[name]] = tensor
            continue
        match = layer.fullmatch(name)
        renamed = None
        if match is not None:
            index, inside = int(match.group(1)), match.group(2)
            renamed = {block_names[inside]: tensor} if inside in block_names else feed_forward(index, inside, tensor)
        if renamed is None:
            raise ForgeError(refusal(name))
        out.update({f"{prefix}.{index}.{other}": other_tensor for other, other_tensor in renamed.items()})
    return out
