"""The lifecycle helpers of PluginManager: configure, plugin state, the manifest."""

from __future__ import annotations

import types

import pytest

from forge_lm import hookimpl
from forge_lm.errors import ConfigError, PluginError
from forge_lm.plugins import BUILTIN_PLUGINS, PluginManager, PluginSettings, PluginStatus


class Recorder:
    """A plugin object that records every lifecycle call and keeps a piece of state."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self, state=None):
        self.calls = []
        self.state = state
        self.loaded = []

    @hookimpl
    def forge_lm_configure(self, config):
        self.calls.append(config)

    @hookimpl
    def forge_lm_save_state(self, context):
        self.calls.append(("save", context))
        return self.state

    @hookimpl
    def forge_lm_load_state(self, context, state):
        self.loaded.append((context, state))


def module_plugin(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(
        compile("from forge_lm import hookimpl\nFORGE_LM_PLUGIN_API = '>=1,<2'\n" + source, name, "exec"), vars(module)
    )
    return module


def test_configure_calls_every_ok_plugins_configure_hook_with_the_config(manager):
    first, second = Recorder(), Recorder()
    manager.add_plugin(first, "first")
    manager.add_plugin(second, "second")
    config = object()

    manager.configure(config)

    assert first.calls == [config]
    assert second.calls == [config]


def test_configure_hook_may_take_no_arguments(manager):
    module = module_plugin("no_args_plugin", "CALLS = []\n@hookimpl\ndef forge_lm_configure():\n    CALLS.append(1)\n")
    manager.add_plugin(module, "no-args")

    manager.configure(object())

    assert module.CALLS == [1]


def test_configure_skips_plugins_that_are_not_ok():
    blocked = Recorder()
    manager = PluginManager(PluginSettings(block=("blocked",)), entry_points=False)
    manager.add_plugin(blocked, "blocked")
    incompatible = Recorder()
    incompatible.FORGE_LM_PLUGIN_API = ">=2"
    manager.add_plugin(incompatible, "incompatible")
    broken = Recorder()
    broken.forge_lm_configur = lambda config: None
    manager.add_plugin(broken, "broken")

    manager.configure("the config")

    assert [manager.plugin(n).status for n in ("blocked", "incompatible", "broken")] == [
        PluginStatus.DISABLED,
        PluginStatus.INCOMPATIBLE,
        PluginStatus.BROKEN,
    ]
    assert blocked.calls == incompatible.calls == broken.calls == []


def test_config_error_raised_by_a_plugin_propagates_unchanged(manager):
    module = module_plugin(
        "rejecting_plugin",
        "from forge_lm.errors import ConfigError\n"
        "@hookimpl\n"
        "def forge_lm_configure(config):\n"
        "    raise ConfigError('[optimizer] name: muon needs [model] n_layers >= 2')\n",
    )
    manager.add_plugin(module, "rejecting")

    with pytest.raises(ConfigError) as caught:
        manager.configure(object())

    assert str(caught.value) == "[optimizer] name: muon needs [model] n_layers >= 2"


def test_save_states_keeps_each_plugins_state_under_its_plugin_name(manager):
    manager.add_plugin(Recorder({"step": 3}), "counter")
    manager.add_plugin(Recorder({"seen": [1, 2]}), "tracker")
    silent = Recorder(None)
    manager.add_plugin(silent, "silent")

    states = manager.save_states("the context")

    assert states == {"counter": {"step": 3}, "tracker": {"seen": [1, 2]}}
    assert silent.calls == [("save", "the context")]


def test_save_states_is_empty_when_only_builtins_are_loaded(manager):
    assert manager.save_states("the context") == {}


def test_load_states_gives_each_plugin_its_own_state_and_returns_the_states_nobody_took(manager):
    counter, tracker, absent = Recorder(), Recorder(), Recorder()
    manager.add_plugin(counter, "counter")
    manager.add_plugin(tracker, "tracker")
    manager.add_plugin(absent, "absent")

    leftover = manager.load_states(
        "the context",
        {"counter": {"step": 3}, "tracker": {"seen": [1]}, "zeta-removed": {}, "alpha-removed": {"x": 1}},
    )

    assert counter.loaded == [("the context", {"step": 3})]
    assert tracker.loaded == [("the context", {"seen": [1]})]
    assert absent.loaded == []
    assert leftover == ["alpha-removed", "zeta-removed"]


def test_state_of_a_plugin_without_a_load_hook_is_returned_as_not_taken(manager):
    module = module_plugin("save_only_plugin", "@hookimpl\ndef forge_lm_save_state(context):\n    return {'n': 1}\n")
    manager.add_plugin(module, "save-only")

    states = manager.save_states("ctx")

    assert states == {"save-only": {"n": 1}}
    assert manager.load_states("ctx", states) == ["save-only"]


def test_saved_states_round_trip_to_the_same_plugins(manager):
    saver = Recorder({"step": 7})
    manager.add_plugin(saver, "saver")

    assert manager.load_states("ctx", manager.save_states("ctx")) == []
    assert saver.loaded == [("ctx", {"step": 7})]


def test_state_saved_for_a_plugin_that_is_now_disabled_is_not_taken():
    saver = Recorder({"step": 1})
    manager = PluginManager(PluginSettings(block=("saver",)), entry_points=False)
    manager.add_plugin(saver, "saver")

    assert manager.load_states("ctx", {"saver": {"step": 1}}) == ["saver"]
    assert saver.loaded == []


def test_manifest_lists_only_ok_plugins_sorted_by_name_with_distribution_and_version(install_plugin):
    install_plugin("forge-zeta", version="2.0", entry_points={"zeta": "forge_zeta"})
    install_plugin("forge-broken", 'raise RuntimeError("boom")')
    install_plugin("forge-old", api='">=0,<1"')
    install_plugin("forge-off")
    manager = PluginManager(PluginSettings(allow=("zeta", "broken", "old")))
    manager.add_plugin(Recorder(), "alpha", distribution="forge-alpha", version="0.1")

    manifest = manager.manifest()

    core = {"distribution": "forge-lm", "version": manager.plugin("core.losses").version}
    assert manifest == sorted(
        [{"name": name, **core} for name in BUILTIN_PLUGINS]
        + [
            {"name": "alpha", "distribution": "forge-alpha", "version": "0.1"},
            {"name": "zeta", "distribution": "forge-zeta", "version": "2.0"},
        ],
        key=lambda entry: entry["name"],
    )


def test_manifest_hash_is_the_same_for_the_same_plugins():
    first = PluginManager(PluginSettings(), entry_points=False)
    second = PluginManager(PluginSettings(), entry_points=False)

    assert first.manifest_hash() == second.manifest_hash()
    assert len(first.manifest_hash()) == 64
    assert int(first.manifest_hash(), 16) >= 0


def test_manifest_hash_changes_when_a_plugin_is_added():
    manager = PluginManager(PluginSettings(), entry_points=False)
    before = manager.manifest_hash()

    manager.add_plugin(Recorder(), "extra")

    assert manager.manifest_hash() != before


def test_manifest_hash_changes_when_a_builtin_is_blocked():
    loaded = PluginManager(PluginSettings(), entry_points=False)
    blocked = PluginManager(PluginSettings(block=("core.losses",)), entry_points=False)

    assert loaded.manifest_hash() != blocked.manifest_hash()


def test_manifest_hash_changes_when_a_plugin_version_changes():
    older = PluginManager(PluginSettings(), entry_points=False)
    older.add_plugin(Recorder(), "extra", distribution="forge-extra", version="1.0")
    newer = PluginManager(PluginSettings(), entry_points=False)
    newer.add_plugin(Recorder(), "extra", distribution="forge-extra", version="1.1")

    assert older.manifest_hash() != newer.manifest_hash()


def test_manifest_hash_ignores_plugins_that_did_not_load():
    plain = PluginManager(PluginSettings(), entry_points=False)
    with_broken = PluginManager(PluginSettings(), entry_points=False)
    broken = Recorder()
    broken.forge_lm_configur = lambda config: None
    with_broken.add_plugin(broken, "broken")

    assert with_broken.plugin("broken").status is PluginStatus.BROKEN
    assert plain.manifest_hash() == with_broken.manifest_hash()


def test_added_plugin_goes_through_the_same_checks_as_an_installed_one(manager):
    class NoRange:
        @hookimpl
        def forge_lm_register_losses(self, register):
            register("local_loss", "forge_fake_impl:build", description="A local loss")

    info = manager.add_plugin(NoRange(), "local", distribution="forge-local", version="0.2")

    assert (info.status, info.module) == (PluginStatus.INCOMPATIBLE, "NoRange")
    assert info.reason.startswith("declares no plugin API range; add FORGE_LM_PLUGIN_API")
    assert info.components == {"losses": ["local_loss"]}
    assert manager.plugin("local") is info


def test_added_module_records_its_module_name(manager):
    module = module_plugin("my_local_plugin", "")

    info = manager.add_plugin(module, "local")

    assert (info.status, info.module, info.distribution, info.version) == (
        PluginStatus.OK,
        "my_local_plugin",
        "<local>",
        "0",
    )


def test_plugin_crashing_in_configure_is_reported_as_a_plugin_error_naming_it(manager):
    module = module_plugin(
        "crashing_plugin",
        "@hookimpl\ndef forge_lm_configure(config):\n    return config.no_such_section\n",
    )
    manager.add_plugin(module, "crashing", distribution="forge-crashing", version="2.0")

    with pytest.raises(PluginError) as caught:
        manager.configure(object())

    assert str(caught.value) == (
        "plugin 'crashing' (forge-crashing 2.0) failed while checking the config: AttributeError: "
        "'object' object has no attribute 'no_such_section'. This is a bug in the plugin: report it to its "
        "authors, or run without it (--block-plugin crashing)."
    )
