"""Fixtures for the plugin-machinery tests: fake plugins with a standard header, managers."""

from __future__ import annotations

import importlib
import textwrap
from collections.abc import Callable

import pytest

from forge_lm.plugins import PluginManager, PluginSettings

HEADER = "from forge_lm import hookimpl\n"
COMPATIBLE = '">=1,<2"'


@pytest.fixture
def install_plugin(fake_site) -> Callable[..., str]:
    """Install a fake distribution whose module starts with ``hookimpl`` imported and, unless
    ``api=None``, ``FORGE_LM_PLUGIN_API = ">=1,<2"``; ``api`` is the attribute's source text."""

    def install(
        dist: str,
        body: str = "",
        *,
        api: str | None = COMPATIBLE,
        version: str = "1.0",
        module: str | None = None,
        entry_points: dict[str, str] | None = None,
    ) -> str:
        header = HEADER if api is None else f"{HEADER}FORGE_LM_PLUGIN_API = {api}\n"
        source = header + textwrap.dedent(body)
        return fake_site.install(dist, source, version=version, module=module, entry_points=entry_points)

    return install


@pytest.fixture
def write_module(fake_site) -> Callable[[str, str], None]:
    """Put a plain module (a lazily imported factory, a dependency) on the fake site."""

    def write(name: str, source: str) -> None:
        (fake_site.root / f"{name}.py").write_text(textwrap.dedent(source))
        fake_site.modules.append(name)
        importlib.invalidate_caches()

    return write


@pytest.fixture
def load_plugins() -> Callable[..., PluginManager]:
    """A manager that loads the built-ins and exactly the named third-party plugins, so the
    first-party plugins installed in the venv (moe, muon, wandb) stay out of the way."""

    def load(*names: str, block: tuple[str, ...] = ()) -> PluginManager:
        return PluginManager(PluginSettings(allow=names, block=block))

    return load


@pytest.fixture
def builtin_names() -> Callable[[str], list[str]]:
    """``builtin_names(category)``: the sorted names the core's own plugins register there.

    Expected lists and messages are built from it, so that adding a built-in component does
    not make them stale, while still asserting exactly which names appear.
    """
    return PluginManager(PluginSettings(), entry_points=False).registry.names
