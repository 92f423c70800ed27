"""The example third-party plugin, installed for real, shows up and passes its own tests.

It is installed with pip into a private directory (a real wheel build and install, with its
dist-info and entry points) that the subprocesses below put on their path, so the
development environment itself is left untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "forge-example-plugin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    target = tmp_path_factory.mktemp("example-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(target), str(EXAMPLE)],
        check=True,
        capture_output=True,
        timeout=300,
    )  # fmt: skip
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}


def _forge(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "forge_lm", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_installed_example_is_listed_with_its_components(installed):
    done = _forge(installed, "list-plugins", "--json")
    assert done.returncode == 0, done.stderr
    plugins = {p["name"]: p for p in json.loads(done.stdout)["plugins"]}
    example = plugins["example"]
    assert (example["distribution"], example["version"], example["status"]) == ("forge-example-plugin", "0.1.0", "ok")
    assert example["components"] == {"losses": ["smoothed_cross_entropy"], "metrics_backends": ["csv"]}


def test_example_components_are_configurable_with_their_own_typed_options(installed):
    done = _forge(
        installed,
        "config", "show",
        "--loss.name=smoothed_cross_entropy", "--loss.smoothing=0.25",
        '--metrics.backends=["console", "csv"]', "--metrics.csv.filename=log.csv",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert '[loss]\nname = "smoothed_cross_entropy"\nsmoothing = 0.25\n' in done.stdout
    assert '[metrics.csv]\nfilename = "log.csv"\n' in done.stdout
    bad = _forge(installed, "config", "validate", "--loss.name=smoothed_cross_entropy", "--loss.smoothing=2")
    assert bad.returncode == 2
    assert bad.stderr == "forge: error: [loss] smoothing: must be between 0 and 1, got 2.0.\n"


def test_example_passes_its_own_conformance_tests(installed):
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests")],
        capture_output=True,
        text=True,
        env=installed,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary
    assert "failed" not in summary
    assert "skipped" not in summary
