"""``python -m forge_lm`` is the ``forge`` command."""

from forge_lm.cli import run

run()
