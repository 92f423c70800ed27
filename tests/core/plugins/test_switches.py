"""The switches that decide which plugins load: autoload, allowlist, blocklist."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from forge_lm.errors import PluginError, UsageError
from forge_lm.plugins import (
    BUILTIN_PLUGINS,
    ENV_ALLOW,
    ENV_BLOCK,
    ENV_DISABLE_AUTOLOAD,
    PluginManager,
    PluginSettings,
    PluginStatus,
)

FORGE_VERSION = importlib.metadata.version("forge-lm")
AUTOLOAD_OFF = "plugin autoloading is off (FORGE_LM_DISABLE_PLUGIN_AUTOLOAD or --no-plugin-autoload)"
NOT_ALLOWED = "not in the plugin allowlist (FORGE_LM_PLUGINS or --plugins)"
BLOCKED = "blocked by FORGE_LM_BLOCK_PLUGINS or --block-plugin"


def test_switch_environment_variable_names():
    assert (ENV_DISABLE_AUTOLOAD, ENV_ALLOW, ENV_BLOCK) == (
        "FORGE_LM_DISABLE_PLUGIN_AUTOLOAD",
        "FORGE_LM_PLUGINS",
        "FORGE_LM_BLOCK_PLUGINS",
    )


def test_empty_environment_loads_every_plugin():
    assert PluginSettings.from_env({}) == PluginSettings(autoload=True, allow=None, block=())


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on", " On "])
def test_true_values_of_the_autoload_variable_disable_autoloading(value):
    assert PluginSettings.from_env({ENV_DISABLE_AUTOLOAD: value}).autoload is False


@pytest.mark.parametrize("value", ["", "0", "false", "no", "off", " OFF "])
def test_false_values_of_the_autoload_variable_keep_autoloading(value):
    assert PluginSettings.from_env({ENV_DISABLE_AUTOLOAD: value}).autoload is True


@pytest.mark.parametrize("value", ["maybe", "2", "disable"])
def test_invalid_autoload_value_is_a_usage_error_naming_the_variable_and_the_valid_values(value):
    with pytest.raises(UsageError) as caught:
        PluginSettings.from_env({ENV_DISABLE_AUTOLOAD: value})

    assert str(caught.value) == (
        f"FORGE_LM_DISABLE_PLUGIN_AUTOLOAD={value!r} is not a boolean; "
        "set it to 1 (disable autoloading) or 0 (load every installed plugin)."
    )


def test_allow_and_block_variables_are_comma_separated_names():
    settings = PluginSettings.from_env({ENV_ALLOW: " moe, fake ,,muon", ENV_BLOCK: "wandb,core.losses, "})

    assert settings.allow == ("moe", "fake", "muon")
    assert settings.block == ("wandb", "core.losses")


def test_set_but_empty_allow_variable_allows_no_third_party_plugin():
    assert PluginSettings.from_env({ENV_ALLOW: ""}).allow == ()


def test_manager_reads_the_switches_from_the_environment_by_default(install_plugin, monkeypatch):
    install_plugin("forge-fake")
    monkeypatch.setenv(ENV_ALLOW, "fake")
    monkeypatch.setenv(ENV_BLOCK, "core.losses")

    manager = PluginManager()

    assert manager.settings == PluginSettings(allow=("fake",), block=("core.losses",))
    assert manager.plugin("fake").status is PluginStatus.OK
    assert manager.plugin("core.losses").status is PluginStatus.DISABLED


def test_invalid_autoload_variable_makes_creating_a_manager_a_usage_error(monkeypatch):
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, "sometimes")

    with pytest.raises(UsageError, match=r"^FORGE_LM_DISABLE_PLUGIN_AUTOLOAD='sometimes' is not a boolean"):
        PluginManager()


def test_command_line_switches_apply_on_top_of_the_environment():
    env = PluginSettings.from_env({ENV_ALLOW: "a,b", ENV_BLOCK: "x"})

    settings = env.with_cli(no_autoload=True, allow="c", block=["y,z", "x", "w"])

    assert settings == PluginSettings(autoload=False, allow=("c",), block=("x", "y", "z", "w"))


def test_command_line_without_switches_keeps_the_environment():
    env = PluginSettings.from_env({ENV_DISABLE_AUTOLOAD: "1", ENV_ALLOW: "a", ENV_BLOCK: "x"})

    assert env.with_cli() == env


def test_command_line_cannot_turn_autoloading_back_on():
    assert PluginSettings(autoload=False).with_cli(no_autoload=False).autoload is False


@pytest.mark.parametrize(
    ("settings", "name", "explicit", "reason"),
    [
        pytest.param(PluginSettings(), "fake", False, None, id="default"),
        pytest.param(PluginSettings(autoload=False), "fake", False, AUTOLOAD_OFF, id="autoload-off"),
        pytest.param(PluginSettings(autoload=False), "core.losses", True, None, id="autoload-off-explicit"),
        pytest.param(PluginSettings(allow=("other",)), "fake", False, NOT_ALLOWED, id="not-allowed"),
        pytest.param(PluginSettings(allow=()), "core.losses", True, None, id="allowlist-skips-explicit"),
        pytest.param(PluginSettings(autoload=False, allow=("fake",)), "fake", False, None, id="allowed-no-auto"),
        pytest.param(PluginSettings(allow=("fake",), block=("fake",)), "fake", False, BLOCKED, id="block-wins"),
        pytest.param(PluginSettings(block=("core.losses",)), "core.losses", True, BLOCKED, id="explicit-blocked"),
    ],
)
def test_disabled_reason_says_which_switch_disables_a_plugin(settings, name, explicit, reason):
    assert settings.disabled_reason(name, explicit=explicit) == reason


def test_autoload_off_disables_third_party_plugins_and_keeps_builtins(install_plugin, builtin_names):
    install_plugin(
        "forge-fake",
        """
        @hookimpl
        def forge_lm_register_losses(register):
            register("fake_loss", "forge_fake_impl:build", description="Never registered")
        """,
    )

    manager = PluginManager(PluginSettings(autoload=False))

    plugin = manager.plugin("fake")
    assert (plugin.status, plugin.reason, plugin.components) == (PluginStatus.DISABLED, AUTOLOAD_OFF, {})
    assert "forge_fake" not in sys.modules
    assert {p.name: p.status for p in manager.plugins if p.builtin} == dict.fromkeys(BUILTIN_PLUGINS, PluginStatus.OK)
    assert {p.status for p in manager.plugins if not p.builtin} == {PluginStatus.DISABLED}
    assert manager.registry.names("losses") == builtin_names("losses")


def test_allowlist_loads_only_the_named_plugins_even_with_autoload_off(install_plugin):
    install_plugin("forge-fake")
    install_plugin("forge-other")

    manager = PluginManager(PluginSettings(autoload=False, allow=("fake",)))

    assert manager.plugin("fake").status is PluginStatus.OK
    other = manager.plugin("other")
    assert (other.status, other.reason) == (PluginStatus.DISABLED, NOT_ALLOWED)
    assert "forge_other" not in sys.modules
    assert {p.status for p in manager.plugins if not p.builtin and p.name != "fake"} == {PluginStatus.DISABLED}


def test_blocklist_wins_over_the_allowlist(install_plugin):
    install_plugin("forge-fake")

    plugin = PluginManager(PluginSettings(allow=("fake",), block=("fake",))).plugin("fake")

    assert (plugin.status, plugin.reason) == (PluginStatus.DISABLED, BLOCKED)
    assert "forge_fake" not in sys.modules


def test_blocked_builtin_registers_nothing_and_resolving_its_component_says_it_is_disabled():
    manager = PluginManager(PluginSettings(block=("core.optimizers",)), entry_points=False)

    plugin = manager.plugin("core.optimizers")
    assert (plugin.status, plugin.reason) == (PluginStatus.DISABLED, BLOCKED)
    assert manager.registry.names("optimizers") == []
    with pytest.raises(PluginError) as caught:
        manager.registry.resolve("optimizers", "adamw")
    assert str(caught.value) == (
        "unknown optimizer 'adamw'.\n"
        "Available optimizers: (none).\n"
        "These installed plugins are not loaded and might provide it:\n"
        f"  plugin 'core.optimizers' (forge-lm {FORGE_VERSION}) is installed but disabled: "
        f"{BLOCKED}. Enable it to use its components."
    )


def test_other_builtins_still_load_when_one_is_blocked():
    manager = PluginManager(PluginSettings(block=("core.optimizers",)), entry_points=False)

    assert manager.registry.resolve("schedulers", "cosine").plugin.name == "core.schedulers"


class _Compatible:
    FORGE_LM_PLUGIN_API = ">=1,<2"


def test_added_plugin_is_subject_to_the_blocklist():
    manager = PluginManager(PluginSettings(block=("mine",)), entry_points=False)

    plugin = manager.add_plugin(_Compatible(), "mine")

    assert (plugin.status, plugin.reason) == (PluginStatus.DISABLED, BLOCKED)


def test_added_plugin_is_explicit_so_autoload_and_allowlist_do_not_disable_it():
    manager = PluginManager(PluginSettings(autoload=False, allow=("other",)), entry_points=False)

    plugin = manager.add_plugin(_Compatible(), "mine")

    assert (plugin.status, plugin.reason) == (PluginStatus.OK, None)


def test_switch_naming_a_plugin_that_is_not_installed_gives_a_warning_with_a_suggestion(install_plugin):
    install_plugin("forge-fake")

    manager = PluginManager(PluginSettings(allow=("fak", "fake"), block=("core.optimiser", "zzzz")))

    assert manager.warnings == [
        "the plugin blocklist names 'core.optimiser', which is not an installed plugin. "
        "Did you mean 'core.optimizers'?",
        "the plugin blocklist names 'zzzz', which is not an installed plugin.",
        "the plugin allowlist names 'fak', which is not an installed plugin. Did you mean 'fake'?",
    ]


def test_switches_naming_installed_plugins_give_no_warning(install_plugin):
    install_plugin("forge-fake")

    manager = PluginManager(PluginSettings(allow=("fake",), block=("core.losses", "moe")))

    assert manager.warnings == []


def test_manager_without_entry_points_does_not_warn_about_third_party_names():
    manager = PluginManager(PluginSettings(allow=("fake",), block=("other",)), entry_points=False)

    assert manager.warnings == []
