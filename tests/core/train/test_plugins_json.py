"""plugins.json records the plugins that ran and, with why, those that could not load."""

from __future__ import annotations

import json

from forge_lm import hookimpl
from forge_lm.train import train
from forge_lm.train.run_manifest import manifest_differences


class _FutureApi:
    FORGE_LM_PLUGIN_API = ">=99"  # a core this old cannot load it


class _Broken:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    @hookimpl
    def forge_lm_no_such_hook(self):  # a typo: the plugin is broken
        pass


def test_incompatible_and_broken_plugins_are_recorded_with_status_and_reason(tiny_config, manager):
    future = manager.add_plugin(_FutureApi(), "future", distribution="forge-future", version="9.0")
    broken = manager.add_plugin(_Broken(), "typo", distribution="forge-typo", version="1.2")
    assert (str(future.status), str(broken.status)) == ("incompatible", "broken")

    run_dir = train(tiny_config("--train.max_steps=1"), manager).run_dir
    recorded = json.loads((run_dir / "plugins.json").read_text())

    assert recorded[: len(manager.manifest())] == manager.manifest()  # the plugins that ran, as before
    unloaded = recorded[len(manager.manifest()) :]
    assert unloaded == [
        {
            "name": "future",
            "distribution": "forge-future",
            "version": "9.0",
            "status": "incompatible",
            "reason": future.reason,
        },
        {"name": "typo", "distribution": "forge-typo", "version": "1.2", "status": "broken", "reason": broken.reason},
    ]
    assert future.reason
    assert broken.reason


def test_resuming_compares_only_the_plugins_that_ran(tiny_config, manager, capsys):
    manager.add_plugin(_FutureApi(), "future", distribution="forge-future", version="9.0")
    config = tiny_config("--train.max_steps=1", "--checkpoint.interval=1")
    train(config, manager)
    capsys.readouterr()

    from forge_lm.config import load_config

    longer = load_config(config.train.output_dir + "/config.toml", ["--train.max_steps=2"], manager.registry)
    train(longer, manager)  # the incompatible plugin is in plugins.json but is not "no longer loaded"
    assert "no longer loaded" not in capsys.readouterr().err


def test_a_loaded_plugin_that_was_only_incompatible_before_is_new_on_resume():
    before = [{"name": "x", "distribution": "forge-x", "version": "1", "status": "incompatible", "reason": "api"}]
    from forge_lm.train.run_manifest import loaded_entries

    after = [{"name": "x", "distribution": "forge-x", "version": "2"}]
    assert manifest_differences(loaded_entries(before), after) == ["plugin 'x' (forge-x) is new"]
