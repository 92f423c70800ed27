"""Fixtures for forge-wandb: the real wandb library, offline and silent, writing only under tmp."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from forge_lm.plugins import PluginManager, PluginSettings


@pytest.fixture(scope="module", autouse=True)
def offline_wandb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """No test reaches a W&B server: offline mode, and every file W&B keeps outside a run
    (settings, caches, service logs) goes to a temporary folder, never the developer's home.
    Whatever the developer's shell exports (an API key, a project, a rank) is left out."""
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.startswith("WANDB_"):
                patch.delenv(name)
        patch.delenv("RANK", raising=False)
        for name, value in {
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "WANDB_CONSOLE": "off",  # leave standard output to pytest
            "WANDB_DISABLE_GIT": "true",
            "WANDB_DISABLE_CODE": "true",
            "WANDB__DISABLE_STATS": "true",  # no system-metrics sampler: less work on 2 cores
            "WANDB_DIR": str(home / "dir"),
            "WANDB_CONFIG_DIR": str(home / "config"),
            "WANDB_CACHE_DIR": str(home / "cache"),
            "WANDB_DATA_DIR": str(home / "data"),
            "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
        }.items():
            patch.setenv(name, value)
        yield home


@pytest.fixture(scope="module")
def wandb_manager() -> PluginManager:
    """The built-ins and forge-wandb, whatever else is installed."""
    return PluginManager(PluginSettings(autoload=False, allow=("wandb",)))


@pytest.fixture(scope="module")
def flush_wandb() -> Callable[[], None]:
    """Make every finished offline run complete on disk before a test reads it.

    ``run.finish()`` returns before W&B's service process has written a run's last records
    (it closes the run's file asynchronously; at the latest when the Python process exits).
    ``wandb.teardown()`` waits for the service to shut down, so the files are complete after
    it; the next ``wandb.init`` starts a new service.
    """

    def flush() -> None:
        import wandb

        wandb.teardown()

    return flush
