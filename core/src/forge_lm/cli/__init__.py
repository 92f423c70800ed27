"""The ``forge`` command."""

from forge_lm.cli._main import main, run

__all__ = ["main", "run"]
