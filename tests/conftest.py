"""Fixtures shared by every test: fresh plugin managers, fake installed plugins, the CLI."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from forge_lm.plugins import PluginManager, PluginSettings


@pytest.fixture(autouse=True)
def _no_plugin_switches_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start from the default switches, whatever the developer's shell exports."""
    for name in list(os.environ):
        if name.startswith("FORGE_LM_"):
            monkeypatch.delenv(name)


@pytest.fixture
def manager() -> PluginManager:
    """A plugin manager with the built-ins only (third-party autoloading off)."""
    return PluginManager(PluginSettings(autoload=False))


class FakeSite:
    """A directory on ``sys.path`` into which tests install real (tiny) distributions.

    Each distribution gets a ``.dist-info`` with METADATA and ``entry_points.txt`` and a
    module, so ``importlib.metadata`` finds it exactly as it finds a pip-installed plugin.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: list[str] = []

    def install(
        self,
        dist: str,
        source: str = "",
        *,
        version: str = "1.0",
        module: str | None = None,
        entry_points: dict[str, str] | None = None,
    ) -> str:
        """Install ``dist`` whose module holds ``source``; return the module name."""
        module = module or dist.replace("-", "_")
        (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        points = entry_points if entry_points is not None else {dist.rpartition("-")[2]: module}
        lines = "".join(f"{name} = {target}\n" for name, target in points.items())
        (info / "entry_points.txt").write_text(f"[forge_lm]\n{lines}")
        self.modules.append(module)
        importlib.invalidate_caches()
        return module


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSite:
    site = FakeSite(tmp_path / "site")
    site.root.mkdir()
    monkeypatch.syspath_prepend(str(site.root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site.root), os.environ.get("PYTHONPATH", "")]))
    yield site
    for module in site.modules:
        sys.modules.pop(module, None)


@pytest.fixture
def forge_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the ``forge`` command in a fresh interpreter; returns the completed process."""

    def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        full_env = {**os.environ, **(env or {})}
        return subprocess.run(
            [sys.executable, "-m", "forge_lm", *args],
            capture_output=True,
            text=True,
            env=full_env,
            cwd=cwd,
            timeout=120,
        )

    return run
