"""Fixtures for the config tests: a plugin manager that sees nothing installed, and loaders.

Exact-message tests use :func:`builtins`, a manager with the core's components only that does
not look at installed distributions, so that a message never depends on which first-party
plugins happen to be installed. Tests about installed plugins build their own manager.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from forge_lm.config import ForgeConfig, load_config
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.plugins import PluginManager, PluginSettings


@pytest.fixture
def builtins() -> PluginManager:
    """Built-in components only; autoloading on, so ``add_plugin`` objects are loaded."""
    return PluginManager(PluginSettings(), entry_points=False)


@pytest.fixture
def write_toml(tmp_path: Path) -> Callable[..., Path]:
    """Write a (dedented) TOML text to a file under ``tmp_path``; return its path."""

    def write(text: str, name: str = "run.toml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return path

    return write


@pytest.fixture
def load(builtins: PluginManager, write_toml: Callable[..., Path]) -> Callable[..., ForgeConfig]:
    """``load(toml_text_or_None, *overrides, manager=builtins)``: the resolved config."""

    def load_(toml: str | None = None, *overrides: str, manager: PluginManager | None = None) -> ForgeConfig:
        path = write_toml(toml) if toml is not None else None
        return load_config(path, list(overrides), (manager or builtins).registry)

    return load_


@pytest.fixture
def error(load: Callable[..., ForgeConfig]) -> Callable[..., str]:
    """``error(toml_text_or_None, *overrides, manager=..., kind=ConfigError)``: the message.

    Fails unless loading raises exactly ``kind`` (not a subclass, not another ForgeError).
    """

    def error_(
        toml: str | None = None,
        *overrides: str,
        manager: PluginManager | None = None,
        kind: type[ForgeError] = ConfigError,
    ) -> str:
        with pytest.raises(ForgeError) as info:
            load(toml, *overrides, manager=manager)
        assert type(info.value) is kind, f"raised {type(info.value).__name__}: {info.value}"
        return str(info.value)

    return error_
