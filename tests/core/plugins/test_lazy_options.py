"""An options class named by its import path (``config="module:Class"``) is imported on first use.

Listing plugins then imports no options module; validating a config that selects the component
imports it and checks it exactly as ``register()`` checks a class it is given. Whatever is wrong
with a lazily named class is a PluginError naming the component, its plugin and the fix, at the
first use, never a traceback.
"""

from __future__ import annotations

import sys

import pytest

from forge_lm.config import load_config
from forge_lm.errors import PluginError
from forge_lm.plugins import PluginStatus

OPTIONS_MODULE = """
import attrs

@attrs.define
class LazyOptions:
    lr: float = 0.5
    clip: float | None = None

@attrs.define
class MaybeNone:
    clip: float | None = 1.0

class NotAttrs:
    lr = 0.5
"""


def plugin_naming(config: str) -> str:
    return f"""
    @hookimpl
    def forge_lm_register_optimizers(register):
        register("lazy", "forge_lazy_impl:build", config={config!r}, description="Options named by path")
    """


@pytest.fixture
def lazy_site(install_plugin, write_module):
    """``install(config_string)``: the fake plugin 'lazy', its options module written beside it."""
    write_module("forge_lazy_options", OPTIONS_MODULE)

    def install(config: str) -> None:
        install_plugin("forge-lazy", plugin_naming(config))

    return install


def test_options_class_named_by_path_is_imported_only_when_first_used(lazy_site, load_plugins, tmp_path):
    lazy_site("forge_lazy_options:LazyOptions")

    manager = load_plugins("lazy")

    assert manager.plugin("lazy").status is PluginStatus.OK
    assert manager.plugin("lazy").components == {"optimizers": ["lazy"]}
    assert "forge_lazy_options" not in sys.modules  # loading and listing did not import it
    config_file = tmp_path / "run.toml"
    config_file.write_text('[optimizer]\nname = "lazy"\nlr = 0.25\n')
    options = load_config(config_file, [], manager.registry).optimizer.options
    module = sys.modules["forge_lazy_options"]
    assert type(options) is module.LazyOptions
    assert (options.lr, options.clip) == (0.25, None)
    assert manager.registry.resolve("optimizers", "lazy").options_class is module.LazyOptions


@pytest.mark.parametrize(
    "config",
    ["forge_lazy_options.LazyOptions", ":LazyOptions", "forge_lazy_options:"],
    ids=["no-colon", "no-module", "no-class"],
)
def test_malformed_options_path_makes_the_plugin_broken_at_registration(lazy_site, load_plugins, config):
    lazy_site(config)

    plugin = load_plugins("lazy").plugin("lazy")

    assert plugin.status is PluginStatus.BROKEN
    assert plugin.reason == f"optimizer 'lazy': config string {config!r} must look like 'package.module:Class'"
    assert plugin.components == {}


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        pytest.param(
            "forge_lazy_missing:Options",
            "cannot be configured: importing its options class 'forge_lazy_missing:Options' failed with "
            "ModuleNotFoundError: No module named 'forge_lazy_missing'. Reinstall it with its dependencies "
            "(pip install --force-reinstall forge-lazy) or uninstall it (pip uninstall forge-lazy).",
            id="missing-module",
        ),
        pytest.param(
            "forge_lazy_options:Gone",
            "cannot be configured: importing its options class 'forge_lazy_options:Gone' failed with "
            "AttributeError: module 'forge_lazy_options' has no attribute 'Gone'.",
            id="missing-class",
        ),
        pytest.param(
            "forge_lazy_options:NotAttrs",
            "cannot be configured: its options class 'forge_lazy_options:NotAttrs' is unusable: config must be an "
            "attrs class, got <class 'forge_lazy_options.NotAttrs'>. This is a bug in forge-lazy 1.0: report it "
            "to its authors.",
            id="not-attrs",
        ),
        pytest.param(
            "forge_lazy_options:MaybeNone",
            "cannot be configured: its options class 'forge_lazy_options:MaybeNone' is unusable: option 'clip' may "
            "be None but defaults to 1.0; a TOML config cannot write None, so default it to None (meaning 'derive "
            "it') or make it non-optional.",
            id="optional-option-with-a-non-none-default",
        ),
    ],
)
def test_unusable_options_class_named_by_path_is_a_plugin_error_at_first_use(
    lazy_site, load_plugins, tmp_path, config, problem
):
    lazy_site(config)
    manager = load_plugins("lazy")
    assert manager.plugin("lazy").status is PluginStatus.OK  # nothing of it was imported yet
    config_file = tmp_path / "run.toml"
    config_file.write_text('[optimizer]\nname = "lazy"\n')

    with pytest.raises(PluginError) as raised:
        load_config(config_file, [], manager.registry)

    message = str(raised.value)
    assert message.startswith("optimizer 'lazy' from plugin 'lazy' (forge-lazy 1.0) " + problem.split(" failed")[0])
    assert problem in message
