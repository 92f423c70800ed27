"""``forge list-plugins`` stays cheap (issue 33: at most 0.10x the time of ``import torch``, measured
by benchmarks/bench_startup.py): it imports none of the heavy modules it used to, checked in a fresh
interpreter with every installed plugin loaded. A module list, not a wall-clock assert.

Options classes are named by import path (plugin API 1.2), so listing imports none of them: not the
core's (``forge_lm.default_plugins.options``, ``forge_lm.config``'s schema with cattrs,
``forge_lm.components``), not the first-party plugins', and so no attrs (the plugin machinery's own
records are dataclasses); ``import forge_lm`` imports no logging (``forge_lm._import_noise`` waits
for torch) and no difflib (needed only for a mistake)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from forge_lm.cli._main import COMMANDS

NOT_IMPORTED = (
    "torch",
    "rich",
    "packaging.requirements",
    "packaging.tags",
    "forge_lm.config",
    "cattrs",
    "forge_lm.components",
    "forge_lm.default_plugins.options",
    "forge_moe.options",
    "forge_deepseek.options",
    "forge_optim_muon.options",
    "forge_vlm.options",
    "forge_vlm.mllama_options",
    "forge_float8.options",
    "forge_lm_eval.options",
    "forge_prometheus.options",
    "forge_wandb.options",
    "attrs",
    "attr",
    "logging",
    "difflib",
)

PROBE = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from forge_lm.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        codes = [main(["list-plugins"]), main(["list-plugins", "--json"])]
    print(json.dumps({"codes": codes, "modules": sorted(sys.modules), "table": out.getvalue()}))
    """
)


def test_list_plugins_imports_no_torch_options_classes_attrs_config_schema_logging_or_other_commands():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["codes"] == [0, 0]
    assert "│ core.optimizers" in report["table"]  # the table was printed, and the plugins loaded
    assert "forge_moe.plugin" in report["modules"]
    assert "forge_lm.default_plugins.optimizers" in report["modules"]
    heavy = [m for m in report["modules"] if any(m == name or m.startswith(f"{name}.") for name in NOT_IMPORTED)]
    assert heavy == []
    commands = {name for name, module in COMMANDS.items() if module in report["modules"]}
    assert commands == {"list-plugins"}
