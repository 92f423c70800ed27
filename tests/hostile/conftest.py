"""Fixtures of the hostile-input suite; the harness itself is ``_hostile.py``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # test modules import the harness as _hostile

from _hostile import run_case, trained_run

__all__ = ["run_case", "trained_run"]
