"""The hostile-input suite keeps its promise of breadth: at least 80 cases over its areas."""

from __future__ import annotations

import importlib

AREAS = (
    "test_checkpoints",
    "test_run_dirs",
    "test_plugins",
    "test_configs",
    "test_interop",
    "test_disk",
    "test_integrity",
    "test_component_failures",
    "test_hangs",
    "test_run_dir_names",
)


def test_the_suite_holds_at_least_80_cases_over_every_area():
    cases = {area: importlib.import_module(area).CASES for area in AREAS}
    assert all(len(table) >= 3 for table in cases.values()), {area: len(table) for area, table in cases.items()}
    assert sum(len(table) for table in cases.values()) >= 80
