"""Transform slots are named by role, not by the plugin that fills them (issue 33); the names of
plugin API 1.0 still work."""

from __future__ import annotations

import pytest

from forge_lm.distributed import TRANSFORM_ORDER, ModelTransform
from forge_lm.distributed.transforms import FORMER_SLOT_NAMES, ordered_transforms
from forge_lm.plugins import PluginManager, PluginSettings


def _noop(*args):
    return True


@pytest.mark.parametrize(("former", "current"), [("float8", "precision"), ("expert_parallel", "model_parallel")])
def test_a_former_slot_name_is_the_slot_it_became(former, current):
    assert ModelTransform(slot=former, enabled=_noop, apply=_noop).slot == current
    assert FORMER_SLOT_NAMES[former] == current
    assert former not in TRANSFORM_ORDER


def test_no_slot_is_named_after_a_transform_of_a_first_party_plugin():
    manager = PluginManager(PluginSettings(autoload=False, allow=("moe", "float8")))
    plugin_transforms = {c.name for c in manager.registry.components("model_transforms") if not c.plugin.builtin}
    assert {"expert_parallel", "moe_load_sync", "float8"} <= plugin_transforms
    assert not plugin_transforms & set(TRANSFORM_ORDER)


def test_the_first_party_transforms_take_the_role_slots_in_order():
    manager = PluginManager(PluginSettings(autoload=False, allow=("moe", "float8")))
    order = {name: transform.slot for name, transform in ordered_transforms(manager.registry)}
    assert order["expert_parallel"] == order["moe_load_sync"] == "model_parallel"
    assert order["float8"] == "precision"
    names = list(order)
    assert names.index("tensor_parallel") < names.index("expert_parallel") < names.index("float8")
    assert names.index("float8") < names.index("activation_checkpointing") < names.index("fsdp2")
