"""Parameter and FLOP counts for throughput and MFU: what one token costs to train."""

from __future__ import annotations

from torch import nn

from forge_lm.components import CountsActiveParameters, CountsFlops
from forge_lm.config import ModelSection


def active_parameter_count(model: nn.Module) -> int:
    """``N``: the parameters one token passes through in matrix multiplies.

    Every parameter counts once, except input embedding tables (``nn.Embedding``: a lookup, not
    a matmul). A head tied to the embedding is a matmul, so the shared tensor counts once, as the
    head. A submodule that defines ``active_parameter_count()`` reports its own number and its
    children are not walked: a mixture-of-experts layer counts only the experts a token visits.
    """
    counted: dict[int, int] = {}  # id(param) -> numel, so shared tensors count once
    reported = 0

    def walk(module: nn.Module) -> None:
        nonlocal reported
        if module is not model and isinstance(module, CountsActiveParameters):
            reported += int(module.active_parameter_count())
            return
        if not isinstance(module, nn.Embedding):
            for param in module.parameters(recurse=False):
                counted[id(param)] = param.numel()
        for child in module.children():
            walk(child)

    walk(model)
    return reported + sum(counted.values())


def model_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token of ``model`` in sequences of ``seq_len``: what the model declares
    (:class:`~forge_lm.components.CountsFlops`), else ``6 * active parameters``."""
    if isinstance(model, CountsFlops):
        return float(model.flops_per_token(seq_len))
    return 6.0 * active_parameter_count(model)


def flops_per_token(config: ModelSection, active_params: int, seq_len: int) -> float:
    """Training FLOPs per token, forward and backward: ``6 * N + 12 * n_layers * d * seq_len``
    with ``d = n_heads * head_size`` (``dim`` unless ``head_dim`` is set).

    ``6 * N``: each active parameter does a multiply-add (2 FLOPs) forward and twice that
    backward. ``12 * L * d * T``: the attention scores and the weighted sum, ``2 * 2 * d * T``
    per layer forward, times 3 with backward (PaLM, appendix B, with ``d = n_heads * head_dim``).
    Causal masking's halving is not subtracted, as in PaLM, so MFU is comparable across papers.
    """
    return 6.0 * active_params + 12.0 * config.n_layers * config.n_heads * config.head_size * seq_len
