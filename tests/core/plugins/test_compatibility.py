"""A plugin declares the plugin API range it supports; outside it the plugin is incompatible.

An incompatible plugin stays listed with its components (so users see what they would get),
but resolving one of them raises the reason, and none of its lifecycle hooks run.
"""

from __future__ import annotations

import sys

import pytest

from forge_lm.errors import PluginError
from forge_lm.plugins import PLUGIN_API_VERSION, PluginStatus

PLUGIN = """
CALLS = []

@hookimpl
def forge_lm_register_optimizers(register):
    register("future_opt", "forge_fake_impl:build", description="From a plugin of another API")

@hookimpl
def forge_lm_configure(config):
    CALLS.append(config)

@hookimpl
def forge_lm_save_state(context):
    return {"step": 1}
"""

NO_RANGE = (
    "declares no plugin API range; add FORGE_LM_PLUGIN_API = \">=1,<2\" to module 'forge_fake' "
    "(this core provides plugin API 1.4)"
)
EXCLUDING = (
    "supports plugin API >=2,<3 but this core provides 1.4; install a release of the plugin made for "
    "this core, or a core that provides API >=2,<3"
)
INVALID = "FORGE_LM_PLUGIN_API = 'banana' is not a valid version range; write e.g. '>=1,<2'"
NOT_A_STRING = "FORGE_LM_PLUGIN_API must be a version range string such as '>=1,<2', got 1"

INCOMPATIBLE_CASES = [
    pytest.param(None, None, NO_RANGE, id="no-range"),
    pytest.param('">=2,<3"', ">=2,<3", EXCLUDING, id="excluding-range"),
    pytest.param('"banana"', "banana", INVALID, id="invalid-range"),
    pytest.param("1", None, NOT_A_STRING, id="not-a-string"),
]


def test_core_provides_plugin_api_1_4():
    assert PLUGIN_API_VERSION == "1.4"


@pytest.mark.parametrize(("api", "recorded", "reason"), INCOMPATIBLE_CASES)
def test_plugin_outside_the_api_range_is_incompatible_with_the_reason(
    install_plugin, load_plugins, api, recorded, reason
):
    install_plugin("forge-fake", PLUGIN, api=api)

    plugin = load_plugins("fake").plugin("fake")

    assert (plugin.status, plugin.reason, plugin.api_range) == (PluginStatus.INCOMPATIBLE, reason, recorded)


@pytest.mark.parametrize(("api", "recorded", "reason"), INCOMPATIBLE_CASES)
def test_incompatible_plugin_keeps_its_components_listed(
    install_plugin, load_plugins, builtin_names, api, recorded, reason
):
    install_plugin("forge-fake", PLUGIN, api=api)

    manager = load_plugins("fake")

    assert manager.plugin("fake").components == {"optimizers": ["future_opt"]}
    assert manager.registry.names("optimizers") == sorted([*builtin_names("optimizers"), "future_opt"])


@pytest.mark.parametrize(("api", "recorded", "reason"), INCOMPATIBLE_CASES)
def test_resolving_a_component_of_an_incompatible_plugin_raises_the_reason(
    install_plugin, load_plugins, api, recorded, reason
):
    install_plugin("forge-fake", PLUGIN, api=api)
    manager = load_plugins("fake")

    for name in ("future_opt", "forge-fake:future_opt"):
        with pytest.raises(PluginError) as caught:
            manager.registry.resolve("optimizers", name)
        assert str(caught.value) == (
            f"optimizer 'future_opt' comes from plugin 'fake' (forge-fake 1.0), which is incompatible: {reason}."
        )


@pytest.mark.parametrize(("api", "recorded", "reason"), INCOMPATIBLE_CASES)
def test_lifecycle_hooks_of_an_incompatible_plugin_are_not_called(install_plugin, load_plugins, api, recorded, reason):
    install_plugin("forge-fake", PLUGIN, api=api)
    manager = load_plugins("fake")

    manager.configure("the config")

    assert sys.modules["forge_fake"].CALLS == []
    assert manager.save_states("context") == {}
    assert "fake" not in [impl.plugin_name for impl in manager.hook.forge_lm_configure.get_hookimpls()]
    assert "fake" not in [p["name"] for p in manager.manifest()]


def test_incompatible_plugin_with_invalid_registrations_is_reported_as_incompatible(install_plugin, load_plugins):
    install_plugin(
        "forge-fake",
        """
        @hookimpl
        def forge_lm_register_optimizers(register):
            register("Future:Opt", "forge_fake_impl:build", description="Invalid under this core's rules")
        """,
        api='">=2,<3"',
    )

    plugin = load_plugins("fake").plugin("fake")

    assert (plugin.status, plugin.reason, plugin.components) == (PluginStatus.INCOMPATIBLE, EXCLUDING, {})


def test_incompatible_plugin_with_an_unknown_hook_is_reported_as_broken(install_plugin, load_plugins):
    install_plugin("forge-fake", "def forge_lm_train_ends(context):\n    pass\n", api='">=2,<3"')

    plugin = load_plugins("fake").plugin("fake")

    assert (plugin.status, plugin.reason) == (
        PluginStatus.BROKEN,
        "implements unknown hook 'forge_lm_train_ends'. Did you mean 'forge_lm_train_end'?",
    )


@pytest.mark.parametrize("api", ['">=1,<2"', '">=1"', '"~=1.0"', '"==1.*"', '">=0.5,<3"', '" >=1 , <2 "'])
def test_plugin_whose_range_includes_this_core_is_ok(install_plugin, load_plugins, api):
    install_plugin("forge-fake", PLUGIN, api=api)
    manager = load_plugins("fake")

    manager.configure("the config")

    assert (manager.plugin("fake").status, manager.plugin("fake").reason) == (PluginStatus.OK, None)
    assert manager.registry.resolve("optimizers", "future_opt").plugin.name == "fake"
    assert sys.modules["forge_fake"].CALLS == ["the config"]


def test_plugin_declaring_an_empty_range_is_incompatible(install_plugin, load_plugins):
    # An empty SpecifierSet admits every version, so "" would switch the check off.
    install_plugin("forge-fake", PLUGIN, api='""')

    plugin = load_plugins("fake").plugin("fake")

    assert plugin.status is PluginStatus.INCOMPATIBLE
    assert "FORGE_LM_PLUGIN_API" in plugin.reason
    assert "'>=1,<2'" in plugin.reason or '">=1,<2"' in plugin.reason


def test_incompatible_copy_of_a_name_does_not_make_the_compatible_one_ambiguous(install_plugin, load_plugins):
    install_plugin(
        "forge-oldopt",
        """
        @hookimpl
        def forge_lm_register_optimizers(register):
            register("adamw", "forge_oldopt:build", description="An old AdamW")
        """,
        api='">=0.1,<1"',
    )
    manager = load_plugins("oldopt")
    assert manager.plugin("oldopt").status == "incompatible"
    assert manager.registry.resolve("optimizers", "adamw").plugin.distribution == "forge-lm"
