"""forge-moe's config checks: router settings the README calls broken are refused by
``forge_lm_configure`` (so ``forge config validate`` catches them), and a later layer that
changes the router or the feed-forward layer drops the earlier layer's options it orphans."""

from __future__ import annotations

import pytest
import torch

from forge_lm.cli import main
from forge_lm.config import load_config
from forge_lm.errors import ConfigError
from forge_moe.routers import SigmoidTopKRouter, SoftmaxTopKRouter

SMALL = ("--model.dim=32", "--model.n_heads=4", "--model.ffn.name=moe")


def _configure(moe_manager, *overrides: str):
    config = load_config(None, [*SMALL, *overrides], moe_manager.registry)
    moe_manager.configure(config)
    return config


def test_softmax_router_with_top_k_1_and_renormalize_is_refused(moe_manager):
    with pytest.raises(ConfigError) as info:
        _configure(moe_manager, "--model.ffn.top_k=1")  # renormalize defaults to true
    message = str(info.value)
    assert message.startswith("[model.ffn.router] renormalize = true with [model.ffn] top_k = 1")
    assert "no gradient" in message
    assert "set renormalize = false" in message


@pytest.mark.parametrize(
    "overrides",
    [
        ("--model.ffn.top_k=1", "--model.ffn.router.renormalize=false"),
        ("--model.ffn.top_k=2",),
        (
            "--model.ffn.top_k=1",
            "--model.ffn.router.name=sigmoid_topk",
            "--model.ffn.router.sequence_balance_loss_weight=1e-4",
        ),
        ("--model.ffn.top_k=2", "--model.ffn.router.name=sigmoid_topk"),
    ],
)
def test_router_settings_that_train_the_router_pass(moe_manager, overrides):
    config = _configure(moe_manager, *overrides)
    assert config.model.options.ffn.options.top_k == int(overrides[0].rpartition("=")[2])


@pytest.mark.parametrize("z_loss", ["0", "1e-3"])  # a z-loss only shrinks the logits: it does not count
def test_sigmoid_router_with_top_k_1_and_no_sequence_loss_is_refused(moe_manager, z_loss):
    with pytest.raises(ConfigError) as info:
        _configure(
            moe_manager,
            "--model.ffn.top_k=1",
            "--model.ffn.router.name=sigmoid_topk",
            f"--model.ffn.router.z_loss_weight={z_loss}",
        )
    message = str(info.value)
    assert message.startswith("[model.ffn.router] sequence_balance_loss_weight = 0 with [model.ffn] top_k = 1")
    assert "set sequence_balance_loss_weight > 0" in message


def _router_grad(router) -> float:
    """The largest gradient the router's weight matrix gets from the combine weights alone."""
    torch.manual_seed(0)
    routing = router(torch.randn(2, 5, 8))
    (routing.weights * torch.randn_like(routing.weights)).sum().backward()
    return router.weight.grad.abs().max().item()


def test_the_refused_routers_really_get_no_gradient_from_the_output():
    # The reason the messages give, checked: with top_k = 1 the combine weights are all 1, and
    # their gradient is rounding error (w / w is not exactly 1 in float32), next to a real one.
    torch.manual_seed(0)
    for refused in (SoftmaxTopKRouter(8, 4, 1, balance_loss_weight=0.0), SigmoidTopKRouter(8, 4, 1)):
        torch.testing.assert_close(refused(torch.randn(2, 5, 8)).weights, torch.ones(10, 1))
        assert _router_grad(refused) < 1e-5
    assert _router_grad(SoftmaxTopKRouter(8, 4, 1, balance_loss_weight=0.0, renormalize=False)) > 1e-3
    assert _router_grad(SigmoidTopKRouter(8, 4, 2)) > 1e-3


def test_config_validate_refuses_the_softmax_trap(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('[model.ffn]\nname = "moe"\ntop_k = 1\n', encoding="utf-8")
    assert main(["config", "validate", str(path), "--plugins", "moe"]) == 2
    assert "renormalize = true with [model.ffn] top_k = 1" in capsys.readouterr().err


MOE_FILE = """
[model.ffn]
name = "moe"
n_experts = 4
top_k = 2
hidden_multiplier = 2.0

[model.ffn.router]
name = "softmax_topk"
balance_loss_weight = 0.02
z_loss_weight = 0.001
"""


def test_a_new_router_on_the_command_line_drops_the_files_options_it_does_not_take(moe_manager, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(MOE_FILE, encoding="utf-8")
    notes: list[str] = []
    config = load_config(path, ["--model.ffn.router.name=sigmoid_topk"], moe_manager.registry, notes)
    router = config.model.options.ffn.options.router
    assert router.name == "sigmoid_topk"
    assert router.options.z_loss_weight == 0.001  # both routers take it: kept
    assert [note.split(",")[0] for note in notes] == ["[model.ffn.router] balance_loss_weight = 0.02"]


def test_a_dense_layer_on_the_command_line_drops_the_moe_options_and_the_router(moe_manager, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(MOE_FILE, encoding="utf-8")
    notes: list[str] = []
    config = load_config(path, ["--model.ffn.name=swiglu"], moe_manager.registry, notes)
    assert config.model.options.ffn.name == "swiglu"
    assert config.model.options.ffn.options.hidden_multiplier == 2.0  # swiglu takes it too
    dropped = sorted(note.split(",")[0] for note in notes)
    assert dropped == ["[model.ffn.router]", "[model.ffn] n_experts = 4", "[model.ffn] top_k = 2"]
