"""Listing plugins and showing a config import no torch, even with every installed plugin loaded."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from forge_lm.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main({argv!r})
    print(json.dumps({{
        "code": code,
        "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
        "first_party": sorted(m for m in ("forge_moe.plugin", "forge_optim_muon.plugin", "forge_wandb.plugin")
                              if m in sys.modules),
    }}))
    """
)


@pytest.mark.parametrize(
    "argv",
    [["list-plugins"], ["list-plugins", "--json"], ["config", "show"]],
    ids=["list-plugins", "list-plugins-json", "config-show"],
)
def test_command_leaves_torch_unimported_with_the_installed_plugins_loaded(argv):
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, timeout=120
    )

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report == {
        "code": 0,
        "torch": [],
        "first_party": ["forge_moe.plugin", "forge_optim_muon.plugin", "forge_wandb.plugin"],
    }
