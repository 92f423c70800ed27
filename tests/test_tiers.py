"""The test tiers of tests/conftest.py: every entry of its slow list names a file, a directory or a
test that exists (a renamed test would silently fall back into the fast tier otherwise), and the
marking follows the entries."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiers(request: pytest.FixtureRequest):
    (conftest,) = [p for p in request.config.pluginmanager.get_plugins() if hasattr(p, "SLOW_TESTS")]
    return conftest


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_slow_entry_names_what_exists(tiers):
    missing = []
    for entry in tiers.SLOW_TESTS:
        path, _, test = entry.partition("::")
        if entry.endswith("/"):
            found = (REPO / entry).is_dir()
        elif not (REPO / path).is_file():
            found = False
        else:
            found = not test or test.partition("[")[0] in _test_names(REPO / path)
        if not found:
            missing.append(entry)
    assert missing == []


def test_the_entries_mark_files_tests_prefixes_and_fixture_users(tiers):
    is_slow = tiers._is_slow
    assert is_slow("tests/core/distributed/test_data_parallel.py::test_any[x]", [])
    assert is_slow("tests/examples/test_slurm_scripts.py::test_any", [])
    assert is_slow("tests/core/checkpoint/test_finite.py::test_two_ranks_agree_on_a_nan_in_one_ranks_shard", [])
    assert not is_slow("tests/core/checkpoint/test_finite.py::test_another", [])
    prefix = "tests/core/testing/test_builtin_conformance.py::test_builtin_component_honours_its_contract"
    assert is_slow(f"{prefix}[optimizers:adamw:lowers_the_loss]", [])
    assert not is_slow(f"{prefix}[losses:cross_entropy:finite]", [])
    assert is_slow("tests/core/config/test_anything.py::test_any", ["tmp_path", "forge_cli"])
    assert not is_slow("tests/core/config/test_anything.py::test_any", ["tmp_path"])


def test_the_fast_tier_deselects_what_the_entries_mark():
    """`-m "not slow"` as make test-fast runs it, on one file with a slow entry and fast tests."""
    finite = "tests/core/checkpoint/test_finite.py"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "not slow", finite],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    collected = [line for line in done.stdout.splitlines() if line.startswith(finite)]
    assert collected
    assert not [line for line in collected if "test_two_ranks_agree_on_a_nan_in_one_ranks_shard" in line]
    assert "1 deselected" in done.stdout
