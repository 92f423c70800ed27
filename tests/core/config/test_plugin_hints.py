"""A config naming a component whose plugin is not installed, blocked or not loaded says so first,
naming the distribution and the switch; the table of first-party components is complete."""

from __future__ import annotations

import importlib.metadata

import pytest

from forge_lm.errors import ConfigError, PluginError
from forge_lm.plugins import PluginManager, PluginSettings, PluginStatus
from forge_lm.plugins._categories import singular
from forge_lm.plugins._hints import FIRST_PARTY, KNOWN_PROVIDERS, known_provider

BLOCKED = "blocked by FORGE_LM_BLOCK_PLUGINS or --block-plugin"
AUTOLOAD_OFF = "plugin autoloading is off (FORGE_LM_DISABLE_PLUGIN_AUTOLOAD or --no-plugin-autoload)"
NOT_ALLOWED = "not in the plugin allowlist (FORGE_LM_PLUGINS or --plugins)"

ENTRIES = [(category, name, dist) for category, names in KNOWN_PROVIDERS.items() for name, dist in names.items()]


def installed(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed")


@pytest.mark.parametrize("dist", FIRST_PARTY)
def test_the_table_lists_exactly_what_each_first_party_plugin_registers(dist):
    installed(dist)
    plugins = [p for p in PluginManager(PluginSettings()).plugins if p.distribution == dist]
    assert plugins, f"{dist} has no plugin entry point"
    registered = {(category, name) for p in plugins for category, names in p.components.items() for name in names}
    listed = {(category, name) for category, name, provider in ENTRIES if provider == dist}
    assert registered == listed


def test_every_distribution_in_the_table_is_first_party():
    assert {dist for _, _, dist in ENTRIES} == set(FIRST_PARTY)


@pytest.mark.parametrize(("category", "name", "dist"), ENTRIES, ids=[f"{c}-{n}" for c, n, _ in ENTRIES])
def test_a_known_component_of_a_distribution_that_is_not_installed_names_it(category, name, dist):
    nothing_installed = PluginManager(PluginSettings(), entry_points=False)
    with pytest.raises(PluginError) as caught:
        nothing_installed.registry.resolve(category, name)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith(f"unknown {singular(category)} '{name}'.")
    assert lines[-1] == f"'{name}' is provided by the package {dist}: pip install {dist}"
    assert known_provider(category, name) == dist


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        pytest.param(PluginSettings(block=("moe",)), BLOCKED, id="blocked"),
        pytest.param(PluginSettings(autoload=False), AUTOLOAD_OFF, id="autoload-off"),
        pytest.param(PluginSettings(allow=("wandb",)), NOT_ALLOWED, id="not-allowed"),
    ],
)
def test_a_component_of_a_disabled_plugin_says_first_which_switch_disabled_it(error, settings, reason):
    version = installed("forge-moe")
    manager = PluginManager(settings)
    assert manager.plugin("moe").status is PluginStatus.DISABLED

    lines = error(None, "--model.ffn.name=moe", manager=manager).splitlines()

    assert lines[0] == (
        f"[model.ffn] name = 'moe': feed-forward layer 'moe' is provided by plugin 'moe' (forge-moe {version}), "
        f"which is installed but disabled: {reason}. Enable it to use its components."
    )
    assert (
        lines[1]
        == f"Available feed-forward layers: {', '.join(repr(n) for n in manager.registry.names('feed_forwards'))}."
    )
    assert not any("unknown" in line for line in lines), "the message must not call a known component unknown"


def test_a_blocked_plugins_optimizer_names_the_blocklist(error):
    version = installed("forge-optim-muon")
    message = error(None, "--optimizer.name=muon", manager=PluginManager(PluginSettings(block=("muon",))))
    assert message.splitlines()[0] == (
        f"[optimizer] name = 'muon': optimizer 'muon' is provided by plugin 'muon' (forge-optim-muon {version}), "
        f"which is installed but disabled: {BLOCKED}. Enable it to use its components."
    )


def test_an_unknown_name_that_no_known_distribution_provides_is_still_unknown(error):
    message = error(None, "--optimizer.name=lamb", manager=PluginManager(PluginSettings(block=("muon",))))
    assert message.splitlines()[0] == "[optimizer] name = 'lamb': unknown optimizer 'lamb'."


def test_a_config_error_for_a_disabled_plugin_is_a_config_error(load):
    installed("forge-moe")
    with pytest.raises(ConfigError):
        load(None, "--model.ffn.name=moe", manager=PluginManager(PluginSettings(block=("moe",))))
