"""The model transforms run in the documented slot order, whoever registered them."""

from __future__ import annotations

import pytest
import torch

from forge_lm.config import load_config
from forge_lm.distributed import TRANSFORM_ORDER, ParallelDims, TransformContext, apply_model_transforms
from forge_lm.distributed.transforms import ordered_transforms
from forge_lm.errors import PluginError
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager, PluginSettings

# A third-party plugin that registers one transform per slot, in scrambled order, each
# appending its name to the model's log when applied.
RECORDING_PLUGIN = """
from forge_lm.distributed import ModelTransform
from forge_lm.hookspecs import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"
SLOTS = {slots!r}

def make(slot):
    def apply(model, context):
        model.applied.append(slot)
    return lambda options: ModelTransform(slot=slot, enabled=lambda context: True, apply=apply)

@hookimpl
def forge_lm_register_model_transforms(register):
    for slot in SLOTS:
        register("record-" + slot.replace("_", "-"), make(slot), description="records " + slot)
"""


def _context(manager, *overrides):
    config = load_config(None, ["--model.dim=32", "--model.n_layers=1", *overrides], manager.registry)
    return config, TransformContext(config, ParallelDims(), None, torch.device("cpu"), None)


def test_plugin_transforms_run_in_slot_order(fake_site) -> None:
    scrambled = list(reversed(TRANSFORM_ORDER))
    fake_site.install("forge-recorder", RECORDING_PLUGIN.format(slots=scrambled))
    manager = PluginManager(PluginSettings())
    assert manager.plugin("recorder").reason is None
    config, context = _context(manager)
    model = build_model(config.model, 64, manager.registry)
    model.applied = []
    applied = apply_model_transforms(model, context, manager.registry)
    assert model.applied == list(TRANSFORM_ORDER)
    # The built-ins are all off in one process with the default config.
    assert applied == ["record-" + slot.replace("_", "-") for slot in TRANSFORM_ORDER]


def test_builtins_take_their_slots(manager) -> None:
    slots = {name: transform.slot for name, transform in ordered_transforms(manager.registry)}
    assert slots == {
        "tensor_parallel": "tensor_parallel",
        "activation_checkpointing": "activation_checkpointing",
        "fsdp2": "data_parallel",
        "compile": "compile",
    }


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("lambda options: ModelTransform('sharding', lambda c: True, lambda m, c: None)", "names slot 'sharding'"),
        ("lambda options: object()", "returned object; its factory must return forge_lm.distributed.ModelTransform"),
    ],
)
def test_a_malformed_transform_is_named(fake_site, factory, message) -> None:
    fake_site.install(
        "forge-badtransform",
        f"""
from forge_lm.distributed import ModelTransform
from forge_lm.hookspecs import hookimpl

@hookimpl
def forge_lm_register_model_transforms(register):
    register("odd", {factory}, description="malformed")
""",
    )
    manager = PluginManager(PluginSettings())
    with pytest.raises(PluginError) as caught:
        ordered_transforms(manager.registry)
    assert "model transform 'odd'" in str(caught.value)
    assert message in str(caught.value)


def test_compile_transform_compiles_every_block_in_place(manager, monkeypatch) -> None:
    compiled = []
    # Each block's bound forward is compiled (its module's call, with FSDP2's hooks, is not).
    monkeypatch.setattr(torch, "compile", lambda forward, **options: compiled.append(forward.__self__) or forward)
    config, context = _context(manager, "--model.n_layers=3", "--train.compile=true")
    model = build_model(config.model, 64, manager.registry)
    names = [name for name, _ in model.named_parameters()]
    assert apply_model_transforms(model, context, manager.registry) == ["compile"]
    assert compiled == list(model.layers)
    assert [name for name, _ in model.named_parameters()] == names
