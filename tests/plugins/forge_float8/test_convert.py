"""Which Linear layers become float8, what the transform prints, and the numbers of one float8 layer."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from forge_float8.convert import HEAD, conversion_plan, convert
from forge_float8.options import Float8Options
from forge_lm.config import load_config
from forge_lm.distributed import ParallelDims, TransformContext, apply_model_transforms
from forge_lm.errors import ConfigError
from forge_lm.model import build_model
from forge_lm.model.linear import Linear as ForgeLinear
from forge_lm.plugins import PluginManager, PluginSettings

from .conftest import ODD, ODD_MESSAGE


def model_of(manager, *overrides):
    config = load_config(None, list(overrides), manager.registry)
    torch.manual_seed(0)
    return config, build_model(config.model, 256, manager.registry)


def linear_types(model):
    return {name: type(module).__name__ for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def test_the_transform_converts_every_fitting_linear_but_the_head_and_says_what_it_skipped(float8_manager, capsys):
    config, model = model_of(float8_manager, *ODD, "--transforms.float8.enabled=true")
    names = [name for name, _ in model.named_parameters()]

    context = TransformContext(config, ParallelDims(), None, torch.device("cpu"), None)
    applied = apply_model_transforms(model, context, float8_manager.registry)

    assert applied == ["float8"]
    assert capsys.readouterr().err == ODD_MESSAGE
    assert linear_types(model) == {
        "layers.0.attention.wq": "Float8Linear",
        "layers.0.attention.wk": "Float8Linear",
        "layers.0.attention.wv": "Float8Linear",
        "layers.0.attention.wo": "Float8Linear",
        "layers.0.feed_forward.w1": "Linear",
        "layers.0.feed_forward.w3": "Linear",
        "layers.0.feed_forward.w2": "Linear",
        "output": "Linear",
    }
    assert [name for name, _ in model.named_parameters()] == names  # checkpoints are layout-independent


def test_a_table_that_is_not_enabled_changes_nothing(float8_manager, capsys):
    config, model = model_of(float8_manager, *ODD, "--transforms.float8.recipe=rowwise")
    context = TransformContext(config, ParallelDims(), None, torch.device("cpu"), None)
    assert apply_model_transforms(model, context, float8_manager.registry) == []
    assert set(linear_types(model).values()) == {"Linear"}
    assert capsys.readouterr().err == ""


def test_the_converted_layers_keep_the_very_parameter_objects(float8_manager):
    _, model = model_of(float8_manager, *ODD)
    before = dict(model.named_parameters())
    convert(model, Float8Options(enabled=True))
    assert all(parameter is before[name] for name, parameter in model.named_parameters())


def test_include_and_exclude_patterns_choose_by_module_name(float8_manager):
    _, model = model_of(float8_manager, "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4")
    options = Float8Options(enabled=True, include=["layers.*.feed_forward.*", HEAD], exclude=["layers.1.*"])
    plan = conversion_plan(model, options)
    assert plan.converted == ("layers.0.feed_forward.w1", "layers.0.feed_forward.w3", "layers.0.feed_forward.w2")
    reasons = dict(plan.skipped)
    assert reasons["output"] == "the output head"  # even when a pattern names it
    assert reasons["layers.0.attention.wq"] == "matches no include pattern"
    assert reasons["layers.1.feed_forward.w1"] == "excluded by 'layers.1.*'"


def test_a_pattern_that_matches_no_linear_layer_is_a_config_error(float8_manager):
    _, model = model_of(float8_manager, *ODD)
    with pytest.raises(ConfigError) as caught:
        conversion_plan(model, Float8Options(enabled=True, exclude=["layers.0.attention.wq", "layer.*.w2"]))
    assert str(caught.value).startswith(
        "[transforms.float8] exclude: ['layer.*.w2'] match no Linear layer of the model; patterns are fnmatch "
        "patterns of module names"
    )
    # A pipeline stage holds some layers only: there an unmatched pattern is no mistake.
    conversion_plan(model, Float8Options(enabled=True, exclude=["layer.*.w2"]), check_patterns=False)


def test_float8_all_gather_does_nothing_in_one_process(float8_manager, capsys):
    gather = ("--transforms.float8.enabled=true", "--transforms.float8.fsdp_float8_all_gather=true")
    config, model = model_of(float8_manager, *ODD, *gather)
    context = TransformContext(config, ParallelDims(), None, torch.device("cpu"), None)
    apply_model_transforms(model, context, float8_manager.registry)
    assert capsys.readouterr().err == ODD_MESSAGE  # no line about gathering in float8
    assert type(model.layers[0].attention.wq.weight.data) is torch.Tensor  # no torchao tensor subclass


def test_forge_moe_experts_and_routers_are_not_linear_layers_and_stay(float8_manager):
    pytest.importorskip("forge_moe")
    manager = PluginManager(PluginSettings(autoload=False, allow=("moe", "float8")))
    moe = ("--model.ffn.name=moe", "--model.ffn.n_experts=4", "--model.ffn.n_shared_experts=1")
    _, model = model_of(manager, "--model.dim=64", "--model.n_layers=1", "--model.n_heads=4", *moe)
    plan = convert(model, Float8Options(enabled=True))
    assert plan.converted == (
        "layers.0.attention.wq",
        "layers.0.attention.wk",
        "layers.0.attention.wv",
        "layers.0.attention.wo",
        "layers.0.feed_forward.shared.w1",
        "layers.0.feed_forward.shared.w3",
        "layers.0.feed_forward.shared.w2",
    )
    assert not isinstance(model.layers[0].feed_forward.experts, nn.Linear)
    assert not isinstance(model.layers[0].feed_forward.router, nn.Linear)


def test_a_subclass_of_linear_is_left_alone():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(32, 32), Scaled(32, 32), ForgeLinear(32, 32))
    convert(model, Float8Options(enabled=True))
    # Forge's own Linear (a CPU kernel choice for its fp32 product) is converted like nn.Linear
    assert [type(m).__name__ for m in model] == ["Float8Linear", "Scaled", "Float8Linear"]


def test_a_model_with_nothing_to_convert_is_refused_listing_why():
    with pytest.raises(ConfigError) as caught:
        convert(nn.Sequential(nn.Linear(24, 32)), Float8Options(enabled=True))
    assert str(caught.value) == (
        "[transforms.float8] enabled = true, but no Linear layer of the model can train in float8:\n"
        "  0: 24 -> 32 features; float8 matmuls need both to be multiples of 16\n"
        "Make the model's sizes multiples of 16, widen include or narrow exclude, or set enabled = false."
    )


def test_a_gpu_without_float8_matmuls_is_refused(float8_manager, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    config, model = model_of(float8_manager, *ODD, "--transforms.float8.enabled=true")
    context = TransformContext(config, ParallelDims(), None, torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ConfigError) as caught:
        apply_model_transforms(model, context, float8_manager.registry)
    assert str(caught.value).startswith(
        "[transforms.float8] enabled = true, but NVIDIA A100-SXM4-80GB (compute capability 8.0) has no float8 "
        "matmuls; they need compute capability 8.9 or newer"
    )
    assert set(linear_types(model).values()) == {"Linear"}  # refused before anything changed


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


# Relative errors of one float8 Linear layer against fp32 (output, input gradient, weight
# gradient). e4m3 keeps 3 mantissa bits: each rounding is off by up to 2^-4 of the value, so
# the matmul of two e4m3 operands lands a few percent from fp32 (measured: 3.7%); tensorwise
# casts output gradients to e5m2 (2 mantissa bits), hence its larger gradient errors (5.9%);
# rowwise_with_gw_hp computes the weight gradient in fp32, exactly. bf16 would give ~0.3%,
# so the lower bounds show float8 really ran.
EXPECTED = {
    "tensorwise": ((0.02, 0.05), (0.04, 0.08), (0.04, 0.08)),
    "rowwise": ((0.02, 0.05), (0.02, 0.05), (0.02, 0.05)),
    "rowwise_with_gw_hp": ((0.02, 0.05), (0.02, 0.05), (0.0, 0.0)),
}


@pytest.mark.parametrize("recipe", list(EXPECTED))
def test_a_float8_layer_is_within_float8_error_of_fp32(recipe):
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(64, 192, bias=False))
    nn.init.normal_(layer[0].weight, std=0.02)
    float8 = copy.deepcopy(layer)
    convert(float8, Float8Options(enabled=True, recipe=recipe))
    assert type(float8[0]).__name__ == "Float8Linear"
    x = torch.randn(256, 64, requires_grad=True)
    x8 = x.detach().clone().requires_grad_()
    out, out8 = layer(x), float8(x8)
    grad = torch.randn_like(out)
    out.backward(grad)
    out8.backward(grad)

    errors = (
        relative_error(out8, out),
        relative_error(x8.grad, x.grad),
        relative_error(float8[0].weight.grad, layer[0].weight.grad),
    )

    for error, (low, high) in zip(errors, EXPECTED[recipe], strict=True):
        assert low <= error <= high, (recipe, errors)
