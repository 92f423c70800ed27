"""Fixtures of the model tests: tiny configs and models built through the plugin registry."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from forge_lm.config import ModelSection
from forge_lm.model import Transformer, build_model

VOCAB = 61  # odd on purpose: no accidental agreement with a power-of-two size


def tiny_fields(**overrides: object) -> dict[str, object]:
    fields: dict[str, object] = {"dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 64, "init_std": 0.1}
    fields.update(overrides)
    return fields


@pytest.fixture
def make_config() -> Callable[..., ModelSection]:
    """``make_config(**fields)``: a tiny ModelSection (dim 32, 2 layers, 4 heads; init_std 0.1 so
    logits are large enough for comparisons to mean something)."""
    return lambda **overrides: ModelSection(**tiny_fields(**overrides))


@pytest.fixture
def make_model(manager) -> Callable[..., Transformer]:
    """``make_model(seed=0, vocab_size=VOCAB, **fields)``: a tiny model, seeded, in eval mode."""

    def make(seed: int = 0, vocab_size: int = VOCAB, **overrides: object) -> Transformer:
        torch.manual_seed(seed)
        return build_model(ModelSection(**tiny_fields(**overrides)), vocab_size, manager.registry).eval()

    return make


def perturb_norms(model: torch.nn.Module, seed: int = 123) -> None:
    """Give every norm scale a distinct value, so a swapped or missing norm changes the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
