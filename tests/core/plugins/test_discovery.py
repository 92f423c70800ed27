"""Plugins are found through entry points in the ``forge_lm`` group; built-ins take the same path."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

import attrs
import pytest

from forge_lm.errors import PluginError
from forge_lm.plugins import (
    BUILTIN_PLUGINS,
    CORE_DISTRIBUTION,
    NoOptions,
    PluginManager,
    PluginSettings,
    PluginStatus,
    core_version,
)

FORGE_VERSION = importlib.metadata.version("forge-lm")


def test_plugin_is_discovered_through_an_entry_point_in_the_forge_lm_group(install_plugin, load_plugins):
    install_plugin("forge-fake", entry_points={"fake": "forge_fake"})

    plugin = load_plugins("fake").plugin("fake")

    assert (plugin.status, plugin.reason) == (PluginStatus.OK, None)


def test_entry_points_of_other_groups_are_not_plugins(install_plugin, fake_site, load_plugins):
    install_plugin("forge-other", entry_points={"other": "forge_other"})
    (fake_site.root / "forge_other-1.0.dist-info" / "entry_points.txt").write_text(
        "[console_scripts]\nother = forge_other\n"
    )
    importlib.invalidate_caches()

    manager = load_plugins("other")

    assert "other" not in [p.name for p in manager.plugins]
    assert "forge_other" not in sys.modules


def test_plugin_name_is_the_entry_point_name_not_the_distribution_or_module_name(install_plugin, load_plugins):
    install_plugin("forge-fancy-thing", module="fancy_impl", entry_points={"sparkle": "fancy_impl"})

    manager = load_plugins("sparkle")

    plugin = manager.plugin("sparkle")
    assert (plugin.name, plugin.distribution, plugin.module) == ("sparkle", "forge-fancy-thing", "fancy_impl")
    assert "forge-fancy-thing" not in [p.name for p in manager.plugins]


def test_distribution_name_and_version_are_recorded_from_the_installed_metadata(install_plugin, load_plugins):
    install_plugin("forge-fake", version="2.3.4")

    plugin = load_plugins("fake").plugin("fake")

    assert (plugin.distribution, plugin.version, plugin.builtin) == ("forge-fake", "2.3.4", False)
    assert plugin.label == "plugin 'fake' (forge-fake 2.3.4)"


def test_declared_api_range_is_recorded(install_plugin, load_plugins):
    install_plugin("forge-fake", api='">=1.0,<2"')

    assert load_plugins("fake").plugin("fake").api_range == ">=1.0,<2"


def test_builtins_are_core_plugins_of_the_forge_lm_distribution(manager):
    builtins = [p for p in manager.plugins if p.builtin]

    assert [p.name for p in builtins] == list(BUILTIN_PLUGINS)
    assert all(p.name.startswith("core.") for p in builtins)
    assert {(p.distribution, p.version, p.status) for p in builtins} == {
        (CORE_DISTRIBUTION, FORGE_VERSION, PluginStatus.OK)
    }
    assert [p.module for p in builtins] == list(BUILTIN_PLUGINS.values())
    assert core_version() == FORGE_VERSION


def test_builtins_go_through_the_same_checks_and_registration_as_installed_plugins(manager):
    optimizers = manager.plugin("core.optimizers")

    assert optimizers.api_range == ">=1,<2"
    assert optimizers.components == {"optimizers": ["adamw", "lion", "schedule_free_adamw"]}
    # In registration order, as each plugin registers them.
    assert manager.plugin("core.schedulers").components == {
        "schedulers": ["constant", "none", "cosine", "linear", "wsd", "rex"]
    }
    assert manager.plugin("core.metrics").components == {"metrics_backends": ["console", "jsonl", "tensorboard"]}
    assert manager.plugin("core.transforms").components == {
        "model_transforms": ["tensor_parallel", "activation_checkpointing", "fsdp2", "compile"]
    }
    registered = [impl.plugin_name for impl in manager.hook.forge_lm_register_optimizers.get_hookimpls()]
    assert registered == ["core.optimizers"]


def test_builtins_are_loaded_first_then_entry_points_sorted_by_distribution(install_plugin, load_plugins):
    install_plugin("forge-zeta", entry_points={"aaa": "forge_zeta"})
    install_plugin("forge-alpha", entry_points={"zzz": "forge_alpha"})

    names = [p.name for p in load_plugins("aaa", "zzz").plugins]

    assert names[: len(BUILTIN_PLUGINS)] == list(BUILTIN_PLUGINS)
    assert names.index("zzz") < names.index("aaa")


def test_manager_without_entry_points_knows_only_the_builtins(install_plugin):
    install_plugin("forge-fake")

    manager = PluginManager(PluginSettings(), entry_points=False)

    assert [p.name for p in manager.plugins] == list(BUILTIN_PLUGINS)
    assert "forge_fake" not in sys.modules


def test_each_component_records_the_plugin_that_provides_it(install_plugin, load_plugins):
    install_plugin(
        "forge-fake",
        """
        @hookimpl
        def forge_lm_register_losses(register):
            register("fake_loss", "forge_fake_impl:build", description="A fake loss")
        """,
    )
    manager = load_plugins("fake")

    fake_loss = manager.registry.resolve("losses", "fake_loss")
    adamw = manager.registry.resolve("optimizers", "adamw")

    assert fake_loss.plugin is manager.plugin("fake")
    assert fake_loss.qualified_name == "forge-fake:fake_loss"
    assert adamw.plugin is manager.plugin("core.optimizers")
    assert adamw.qualified_name == "forge-lm:adamw"
    assert manager.plugin("fake").components == {"losses": ["fake_loss"]}


def test_plugin_registers_components_in_several_categories(install_plugin, load_plugins):
    install_plugin(
        "forge-fake",
        """
        @hookimpl
        def forge_lm_register_routers(register):
            register("top2", "forge_fake_impl:top2", description="Top-2 router")
            register("top1", "forge_fake_impl:top1", description="Top-1 router")

        @hookimpl
        def forge_lm_register_feed_forwards(register):
            register("moe_ffn", "forge_fake_impl:moe", description="Mixture of experts")
        """,
    )

    manager = load_plugins("fake")

    assert manager.plugin("fake").as_dict()["components"] == {
        "feed_forwards": ["moe_ffn"],
        "routers": ["top1", "top2"],
    }
    assert manager.registry.names("routers") == ["top1", "top2"]


def test_component_registered_without_config_gets_empty_options_and_a_stripped_description(
    install_plugin, load_plugins
):
    install_plugin(
        "forge-fake",
        """
        @hookimpl
        def forge_lm_register_losses(register):
            register("plain", "forge_fake_impl:build", description="  Plain loss  ")
        """,
    )

    component = load_plugins("fake").registry.resolve("losses", "plain")

    assert component.options_class is NoOptions
    assert component.description == "Plain loss"


def test_string_factory_is_imported_only_when_the_component_is_built(install_plugin, write_module, load_plugins):
    install_plugin(
        "forge-fake",
        """
        import attrs

        @attrs.define
        class FakeOptions:
            scale: float = 2.0

        @hookimpl
        def forge_lm_register_losses(register):
            register("scaled", "forge_fake_impl:build", config=FakeOptions, description="Scaled")
        """,
    )
    write_module(
        "forge_fake_impl",
        """
        def build(options, *args, **kwargs):
            return ("built", options.scale, args, kwargs)
        """,
    )
    manager = load_plugins("fake")
    component = manager.registry.resolve("losses", "scaled")
    assert "forge_fake_impl" not in sys.modules

    built = component.build(component.options_class(), 1, key="value")

    assert built == ("built", 2.0, (1,), {"key": "value"})
    assert "forge_fake_impl" in sys.modules
    assert attrs.has(component.options_class)


def test_callable_factory_is_used_as_is(install_plugin, load_plugins):
    install_plugin(
        "forge-fake",
        """
        def build(options):
            return "built"

        @hookimpl
        def forge_lm_register_losses(register):
            register("direct", build, description="Direct factory")
        """,
    )

    component = load_plugins("fake").registry.resolve("losses", "direct")

    assert component.load_factory() is sys.modules["forge_fake"].build
    assert component.build(NoOptions()) == "built"


def test_asking_for_an_unknown_plugin_suggests_a_close_name(manager):
    with pytest.raises(PluginError) as caught:
        manager.plugin("core.optimizer")

    assert str(caught.value) == "no plugin named 'core.optimizer'. Did you mean 'core.optimizers'?"
