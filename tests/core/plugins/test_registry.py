"""The registry: one for every category; resolves the names a config uses, or says why not."""

from __future__ import annotations

import importlib.metadata

import attrs
import pytest

from forge_lm.errors import PluginError
from forge_lm.plugins import (
    CATEGORIES,
    Component,
    NoOptions,
    PluginInfo,
    PluginManager,
    PluginSettings,
    PluginStatus,
    Registry,
)

FORGE_VERSION = importlib.metadata.version("forge-lm")
MUON_VERSION = importlib.metadata.version("forge-optim-muon")
ALL_CATEGORIES = (
    "'attentions', 'datasets', 'evaluators', 'feed_forwards', 'losses', 'metrics_backends', 'model_transforms', "
    "'models', 'optimizers', 'routers', 'schedulers', 'tokenizers'"
)
REGISTERS_ADAMW = """
@hookimpl
def forge_lm_register_optimizers(register):
    register("adamw", "forge_fake_impl:build", description="Another AdamW")
"""


@pytest.fixture
def builtins_only() -> PluginManager:
    """The built-ins and no entry points: messages do not depend on what else is installed."""
    return PluginManager(PluginSettings(), entry_points=False)


def component(name: str, plugin: PluginInfo, category: str = "optimizers") -> Component:
    return Component(category, name, "forge_fake_impl:build", NoOptions, "A component", plugin)


def quoted(names: list[str]) -> str:
    """Names as a message lists them: ``'a', 'b'``."""
    return ", ".join(f"'{name}'" for name in names)


def test_every_category_has_a_singular_noun_and_a_registration_hook(manager):
    assert list(CATEGORIES) == [
        "optimizers",
        "schedulers",
        "losses",
        "datasets",
        "metrics_backends",
        "tokenizers",
        "models",
        "attentions",
        "feed_forwards",
        "routers",
        "model_transforms",
        "evaluators",
    ]
    for category in CATEGORIES:
        assert hasattr(manager.hook, f"forge_lm_register_{category}")


@pytest.mark.parametrize("method", ["names", "components", "resolve", "providers"])
def test_unknown_category_is_an_error_listing_the_categories_with_a_suggestion(builtins_only, method):
    args = ("optimiser",) if method in ("names", "components") else ("optimiser", "adamw")

    with pytest.raises(PluginError) as caught:
        getattr(builtins_only.registry, method)(*args)

    assert str(caught.value) == (
        f"unknown component category 'optimiser'. Did you mean 'optimizers'? Categories: {ALL_CATEGORIES}."
    )


def test_unknown_category_far_from_every_real_one_lists_the_categories(builtins_only):
    with pytest.raises(PluginError) as caught:
        builtins_only.registry.names("widgets")

    assert str(caught.value) == f"unknown component category 'widgets'. Categories: {ALL_CATEGORIES}."


def test_names_and_components_are_sorted_by_name(install_plugin, load_plugins, builtin_names):
    install_plugin(
        "forge-fake",
        """
        @hookimpl
        def forge_lm_register_schedulers(register):
            register("zigzag", "forge_fake_impl:zigzag", description="Zigzag")
            register("aaa_linear", "forge_fake_impl:linear", description="Linear")
        """,
    )

    registry = load_plugins("fake").registry
    expected = ["aaa_linear", *builtin_names("schedulers"), "zigzag"]

    assert registry.names("schedulers") == expected
    assert [c.name for c in registry.components("schedulers")] == expected
    assert registry.names("routers") == []


def test_same_name_from_two_distributions_installs_but_the_bare_name_is_ambiguous(install_plugin, load_plugins):
    install_plugin("forge-fake", REGISTERS_ADAMW, version="1.2")
    manager = load_plugins("fake")

    assert manager.plugin("fake").status is PluginStatus.OK
    assert [c.plugin.name for c in manager.registry.providers("optimizers", "adamw")] == ["core.optimizers", "fake"]
    with pytest.raises(PluginError) as caught:
        manager.registry.resolve("optimizers", "adamw")
    assert str(caught.value) == (
        f"optimizer 'adamw' is provided by 2 distributions: forge-lm {FORGE_VERSION} (plugin 'core.optimizers') "
        "and forge-fake 1.2 (plugin 'fake'). "
        'Choose one: name = "forge-lm:adamw" or name = "forge-fake:adamw".'
    )


@pytest.mark.parametrize(
    ("qualified", "distribution"),
    [
        ("forge-fake:adamw", "forge-fake"),
        ("forge_fake:adamw", "forge-fake"),
        ("Forge.Fake:adamw", "forge-fake"),
        ("forge-lm:adamw", "forge-lm"),
        ("forge_lm:adamw", "forge-lm"),
    ],
)
def test_distribution_qualified_name_selects_one_provider(install_plugin, load_plugins, qualified, distribution):
    install_plugin("forge-fake", REGISTERS_ADAMW)

    component = load_plugins("fake").registry.resolve("optimizers", qualified)

    assert (component.name, component.plugin.distribution) == ("adamw", distribution)


def test_qualified_name_works_when_the_name_is_not_ambiguous(builtins_only):
    assert builtins_only.registry.resolve("optimizers", "forge-lm:adamw").plugin.name == "core.optimizers"


def test_qualifying_with_a_distribution_that_does_not_provide_the_name_is_an_error(install_plugin, load_plugins):
    install_plugin("forge-fake", REGISTERS_ADAMW)
    registry = load_plugins("fake").registry

    with pytest.raises(PluginError) as caught:
        registry.resolve("optimizers", "forge-other:adamw")

    assert str(caught.value) == (
        "optimizer 'adamw' is not provided by a distribution named 'forge-other'; it is provided by "
        f"forge-lm {FORGE_VERSION} (plugin 'core.optimizers') and forge-fake 1.0 (plugin 'fake')."
    )


def test_unknown_name_suggests_a_close_one_and_lists_names_and_plugins(builtins_only, builtin_names):
    with pytest.raises(PluginError) as caught:
        builtins_only.registry.resolve("optimizers", "adamm")

    assert str(caught.value) == (
        "unknown optimizer 'adamm'. Did you mean 'adamw'?\n"
        f"Available optimizers: {quoted(builtin_names('optimizers'))}.\n"
        f"Installed plugins offering optimizers: plugin 'core.optimizers' (forge-lm {FORGE_VERSION})."
    )


def test_unknown_qualified_name_reports_the_bare_name(builtins_only, builtin_names):
    with pytest.raises(PluginError) as caught:
        builtins_only.registry.resolve("schedulers", "forge-lm:cosin")

    assert str(caught.value) == (
        "unknown scheduler 'cosin'. Did you mean 'cosine'?\n"
        f"Available schedulers: {quoted(builtin_names('schedulers'))}.\n"
        f"Installed plugins offering schedulers: plugin 'core.schedulers' (forge-lm {FORGE_VERSION})."
    )


def test_unknown_name_in_an_empty_category_says_none_are_available(builtins_only):
    with pytest.raises(PluginError) as caught:
        builtins_only.registry.resolve("routers", "hash")

    assert str(caught.value) == "unknown router 'hash'.\nAvailable routers: (none)."


@pytest.mark.parametrize(
    ("category", "name", "package", "lines"),
    [
        pytest.param(
            "metrics_backends",
            "wandb",
            "forge-wandb",
            "unknown metrics backend 'wandb'.\n"
            "Available metrics backends: {available}.\n"
            f"Installed plugins offering metrics backends: plugin 'core.metrics' (forge-lm {FORGE_VERSION}).\n",
            id="backend-wandb",
        ),
        pytest.param(
            "optimizers",
            "muon",
            "forge-optim-muon",
            "unknown optimizer 'muon'.\n"
            "Available optimizers: {available}.\n"
            f"Installed plugins offering optimizers: plugin 'core.optimizers' (forge-lm {FORGE_VERSION}).\n",
            id="optimizer-muon",
        ),
        pytest.param(
            "feed_forwards",
            "moe",
            "forge-moe",
            "unknown feed-forward layer 'moe'.\n"
            "Available feed-forward layers: {available}.\n"
            "Installed plugins offering feed-forward layers: "
            f"plugin 'core.feed_forwards' (forge-lm {FORGE_VERSION}).\n",
            id="feed-forward-moe",
        ),
        pytest.param(
            "routers",
            "sigmoid_topk",
            "forge-moe",
            "unknown router 'sigmoid_topk'.\nAvailable routers: (none).\n",
            id="router-sigmoid-topk",
        ),
    ],
)
def test_known_first_party_name_that_is_not_installed_names_the_package_to_install(
    builtins_only, builtin_names, category, name, package, lines
):
    with pytest.raises(PluginError) as caught:
        builtins_only.registry.resolve(category, name)

    lines = lines.format(available=quoted(builtin_names(category)))
    assert str(caught.value) == f"{lines}'{name}' is provided by the package {package}: pip install {package}"


def test_known_name_whose_plugin_is_blocked_says_the_installed_plugin_is_disabled(builtin_names):
    manager = PluginManager(PluginSettings(allow=(), block=("muon",)))

    with pytest.raises(PluginError) as caught:
        manager.registry.resolve("optimizers", "muon")

    assert str(caught.value) == (
        f"optimizer 'muon' is provided by plugin 'muon' (forge-optim-muon {MUON_VERSION}), which is installed but "
        "disabled: blocked by FORGE_LM_BLOCK_PLUGINS or --block-plugin. Enable it to use its components.\n"
        f"Available optimizers: {quoted(builtin_names('optimizers'))}.\n"
        f"Installed plugins offering optimizers: plugin 'core.optimizers' (forge-lm {FORGE_VERSION})."
    )


def test_known_name_whose_plugin_is_broken_says_how_to_fix_the_installed_plugin(
    install_plugin, load_plugins, builtin_names
):
    install_plugin(
        "forge-optim-muon",
        "import forge_missing_dependency",
        version="9.9",
        module="fake_muon",
        entry_points={"muon": "fake_muon"},
    )
    manager = load_plugins("muon")

    with pytest.raises(PluginError) as caught:
        manager.registry.resolve("optimizers", "muon")

    assert str(caught.value) == (
        "unknown optimizer 'muon'.\n"
        f"Available optimizers: {quoted(builtin_names('optimizers'))}.\n"
        f"Installed plugins offering optimizers: plugin 'core.optimizers' (forge-lm {FORGE_VERSION}).\n"
        "plugin 'muon' (forge-optim-muon 9.9) is installed but broken: import failed: ModuleNotFoundError: "
        "No module named 'forge_missing_dependency'. Fix: reinstall it with its dependencies "
        "(pip install --force-reinstall forge-optim-muon) or remove it (pip uninstall forge-optim-muon)."
    )


def test_known_name_missing_from_an_installed_working_plugin_says_to_upgrade_it(
    install_plugin, load_plugins, builtin_names
):
    install_plugin("forge-wandb", version="0.0.1", module="fake_wandb", entry_points={"wandb": "fake_wandb"})
    manager = load_plugins("wandb")

    with pytest.raises(PluginError) as caught:
        manager.registry.resolve("metrics_backends", "wandb")

    assert str(caught.value) == (
        "unknown metrics backend 'wandb'.\n"
        f"Available metrics backends: {quoted(builtin_names('metrics_backends'))}.\n"
        f"Installed plugins offering metrics backends: plugin 'core.metrics' (forge-lm {FORGE_VERSION}).\n"
        "plugin 'wandb' (forge-wandb 0.0.1) is installed but does not provide it; a newer release may: "
        "pip install --upgrade forge-wandb"
    )


def test_unknown_name_lists_installed_plugins_that_are_not_loaded(install_plugin, builtin_names):
    install_plugin("forge-broken", 'raise RuntimeError("boom")', version="2.3")
    install_plugin("forge-off")
    manager = PluginManager(PluginSettings(allow=("broken",), block=("off",)))

    with pytest.raises(PluginError) as caught:
        manager.registry.resolve("optimizers", "lamb")

    message = str(caught.value)
    assert message.startswith(
        "unknown optimizer 'lamb'.\n"
        f"Available optimizers: {quoted(builtin_names('optimizers'))}.\n"
        f"Installed plugins offering optimizers: plugin 'core.optimizers' (forge-lm {FORGE_VERSION}).\n"
        "These installed plugins are not loaded and might provide it:\n"
    )
    assert (
        "\n  plugin 'broken' (forge-broken 2.3) is installed but broken: import failed: RuntimeError: boom. "
        "Fix: reinstall it with its dependencies (pip install --force-reinstall forge-broken) "
        "or remove it (pip uninstall forge-broken).\n"
    ) in message
    assert (
        "\n  plugin 'off' (forge-off 1.0) is installed but disabled: "
        "blocked by FORGE_LM_BLOCK_PLUGINS or --block-plugin. Enable it to use its components."
    ) in message


def test_installed_plugins_offering_the_category_include_third_party_ones(install_plugin, load_plugins, builtin_names):
    install_plugin(
        "forge-fake",
        """
        @hookimpl
        def forge_lm_register_optimizers(register):
            register("lamb", "forge_fake_impl:build", description="LAMB")
        """,
        version="3.1",
    )
    manager = load_plugins("fake")

    with pytest.raises(PluginError) as caught:
        manager.registry.resolve("optimizers", "lam")

    assert str(caught.value).split("\n")[:3] == [
        "unknown optimizer 'lam'. Did you mean 'lamb'?",
        f"Available optimizers: {quoted(sorted([*builtin_names('optimizers'), 'lamb']))}.",
        f"Installed plugins offering optimizers: plugin 'core.optimizers' (forge-lm {FORGE_VERSION}), "
        "plugin 'fake' (forge-fake 3.1).",
    ]


def test_registry_refuses_a_name_added_twice_by_one_distribution():
    registry = Registry()
    one = PluginInfo("one", "forge-fake", "1.0", "forge_fake")
    two = PluginInfo("two", "forge-fake", "1.0", "forge_fake_two")
    registry.add(component("shared", one))

    with pytest.raises(PluginError) as caught:
        registry.add(component("shared", two))

    assert str(caught.value) == "optimizer 'shared' is registered twice by forge-fake (plugins 'one' and 'two')"
    assert [c.plugin.name for c in registry.providers("optimizers", "shared")] == ["one"]


def test_registry_refuses_a_component_of_an_unknown_category():
    plugin = PluginInfo("one", "forge-fake", "1.0", "forge_fake")

    with pytest.raises(PluginError, match=r"^unknown component category 'widgets'\. Categories: "):
        Registry().add(component("shared", plugin, category="widgets"))


@pytest.mark.parametrize("status", [PluginStatus.BROKEN, PluginStatus.DISABLED])
def test_registry_refuses_to_resolve_a_component_of_an_unusable_plugin(status):
    plugin = PluginInfo("one", "forge-fake", "1.0", "forge_fake", status=status, reason="whatever")
    registry = Registry([plugin])
    registry.add(component("lamb", plugin))

    with pytest.raises(PluginError) as caught:
        registry.resolve("optimizers", "lamb")

    assert str(caught.value) == f"optimizer 'lamb' comes from plugin 'one' (forge-fake 1.0), which is {status}."


def test_failed_factory_import_at_build_time_names_the_distribution_its_version_and_the_fix(
    install_plugin, write_module, load_plugins
):
    install_plugin(
        "forge-fake",
        """
        @hookimpl
        def forge_lm_register_optimizers(register):
            register("lamb", "forge_fake_impl:build_lamb", description="LAMB")
        """,
        version="0.3.1",
    )
    write_module("forge_fake_impl", "import forge_missing_dependency\n")
    component = load_plugins("fake").registry.resolve("optimizers", "lamb")

    expected = (
        "optimizer 'lamb' from plugin 'fake' (forge-fake 0.3.1) cannot be built: importing "
        "'forge_fake_impl:build_lamb' failed with ModuleNotFoundError: No module named 'forge_missing_dependency'. "
        "Reinstall it with its dependencies (pip install --force-reinstall forge-fake) or uninstall it "
        "(pip uninstall forge-fake)."
    )
    with pytest.raises(PluginError) as caught:
        component.load_factory()
    assert str(caught.value) == expected
    with pytest.raises(PluginError) as caught:
        component.build(NoOptions(), "model")
    assert str(caught.value) == expected


def test_factory_attribute_missing_at_build_time_is_a_plugin_error(install_plugin, write_module, load_plugins):
    install_plugin(
        "forge-fake",
        """
        @hookimpl
        def forge_lm_register_losses(register):
            register("smooth", "forge_fake_impl:build_smooth", description="Smooth")
        """,
    )
    write_module("forge_fake_impl", "def build_other(options):\n    pass\n")
    component = load_plugins("fake").registry.resolve("losses", "smooth")

    with pytest.raises(PluginError) as caught:
        component.build(NoOptions())

    assert str(caught.value) == (
        "loss 'smooth' from plugin 'fake' (forge-fake 1.0) cannot be built: importing "
        "'forge_fake_impl:build_smooth' failed with AttributeError: module 'forge_fake_impl' has no attribute "
        "'build_smooth'. Reinstall it with its dependencies (pip install --force-reinstall forge-fake) or "
        "uninstall it (pip uninstall forge-fake)."
    )


def test_registered_options_class_is_kept_for_config_validation(install_plugin, load_plugins):
    install_plugin(
        "forge-fake",
        """
        import attrs

        @attrs.define
        class LambOptions:
            lr: float = 1e-4
            beta: float = 0.9

        @hookimpl
        def forge_lm_register_optimizers(register):
            register("lamb", "forge_fake_impl:build", config=LambOptions, description="LAMB")
        """,
    )

    options_class = load_plugins("fake").registry.resolve("optimizers", "lamb").options_class

    assert [f.name for f in attrs.fields(options_class)] == ["lr", "beta"]


def test_unknown_category_that_is_a_prefix_of_a_real_one_gets_a_suggestion(manager):
    with pytest.raises(PluginError) as caught:
        manager.registry.names("metric")
    assert str(caught.value).startswith("unknown component category 'metric'. Did you mean 'metrics_backends'?")
