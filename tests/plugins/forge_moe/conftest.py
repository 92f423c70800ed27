"""Shared by the forge-moe tests: a plugin manager with forge-moe, tiny MoE models, and the
formulas of the routers' losses written out as plain-Python loops (the independent references)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from forge_lm.config import structure_config
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager, PluginSettings

VOCAB = 61


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The models here are tiny: one thread computes them as fast as two, and a machine busy with
    other jobs cannot stall it at thread barriers. The previous setting is restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def moe_manager() -> PluginManager:
    """The built-ins and forge-moe only, whatever else is installed."""
    return PluginManager(PluginSettings(allow=("moe",)))


def model_section(manager: PluginManager, ffn: dict[str, Any], **model: Any) -> Any:
    """A resolved ``[model]`` section (routers resolved, as the loader does) with an MoE ``ffn``."""
    fields = {"dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 64, "init_std": 0.1, **model}
    table = {"model": {**fields, "ffn": {"name": "moe", **ffn}}, "train": {"seq_len": fields["max_seq_len"]}}
    return structure_config(table, manager.registry).model


@pytest.fixture
def make_moe_model(moe_manager) -> Callable[..., torch.nn.Module]:
    """``make_moe_model(ffn={...}, seed=0, **model_fields)``: a tiny MoE model in eval mode."""

    def make(ffn: dict[str, Any] | None = None, seed: int = 0, **model: Any) -> torch.nn.Module:
        torch.manual_seed(seed)
        return build_model(model_section(moe_manager, ffn or {}, **model), VOCAB, moe_manager.registry).eval()

    return make


def ref_softmax(row: Sequence[float]) -> list[float]:
    exps = [math.exp(v) for v in row]
    return [e / sum(exps) for e in exps]


def ref_sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def ref_fractions(chosen: Sequence[Sequence[int]], n_experts: int) -> list[float]:
    """f_i: the share of all (token, choice) assignments that go to expert i."""
    total = sum(len(c) for c in chosen)
    return [sum(row.count(i) for row in chosen) / total for i in range(n_experts)]


def ref_switch_balance(probs: Sequence[Sequence[float]], chosen: Sequence[Sequence[int]]) -> float:
    """E * sum_i f_i * P_i over every token."""
    n_experts = len(probs[0])
    f = ref_fractions(chosen, n_experts)
    p = [sum(row[i] for row in probs) / len(probs) for i in range(n_experts)]
    return n_experts * sum(fi * pi for fi, pi in zip(f, p, strict=True))


def ref_sequence_balance(
    scores: Sequence[Sequence[Sequence[float]]], chosen: Sequence[Sequence[Sequence[int]]]
) -> float:
    """DeepSeek-V3: per sequence sum_i f_i * P_i with f_i = E / (k T) * count_i and
    P_i = mean_t s_it / sum_j s_jt; then the mean over sequences."""
    per_sequence = []
    for seq_scores, seq_chosen in zip(scores, chosen, strict=True):
        n_experts, tokens, top_k = len(seq_scores[0]), len(seq_scores), len(seq_chosen[0])
        f = [n_experts / (top_k * tokens) * sum(row.count(i) for row in seq_chosen) for i in range(n_experts)]
        p = [sum(row[i] / sum(row) for row in seq_scores) / tokens for i in range(n_experts)]
        per_sequence.append(sum(fi * pi for fi, pi in zip(f, p, strict=True)))
    return sum(per_sequence) / len(per_sequence)


def ref_z_loss(logits: Sequence[Sequence[float]]) -> float:
    return sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / len(logits)


def ref_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on one token, written out: w2 @ (silu(w1 @ x) * (w3 @ x))."""
    gate, up = w1 @ x, w3 @ x
    return w2 @ (gate * torch.sigmoid(gate) * up)
