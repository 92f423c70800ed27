"""forge-lm-eval's README says what the plugin does: its config snippet loads, its tables list the
options and switches there are, its example task is the tests' task, and what it shows `forge eval`
printing is what it prints."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from forge_lm.cli import _main
from forge_lm.cli._main import build_parser, main
from forge_lm.config import load_config
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing.markdown import code_block, code_blocks
from forge_lm_eval.options import LmEvalOptions

from .conftest import CHOICE, TASKS

README = Path(__file__).resolve().parents[3] / "plugins" / "forge-lm-eval" / "README.md"
TEXT = README.read_text(encoding="utf-8")


def blocks() -> list[tuple[str, str]]:
    return code_blocks(TEXT)


def block(language: str, containing: str) -> str:
    return code_block(TEXT, language, containing)


def section(title: str) -> str:
    return re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#)", TEXT, flags=re.MULTILINE | re.DOTALL).group(1)


def test_the_toml_snippet_loads_with_the_evaluator_and_its_options(tmp_path):
    config_file = tmp_path / "run.toml"
    config_file.write_text(block("toml", "[eval.lm_eval]"))
    manager = PluginManager(PluginSettings(autoload=False, allow=("lm_eval",)))

    config = load_config(config_file, [], manager.registry)

    (evaluator,) = config.eval.evaluators
    assert evaluator.name == "lm_eval"
    assert evaluator.options == LmEvalOptions(tasks=["hellaswag", "my_tasks/qa.yaml"], limit=500, every=2)


def test_the_options_table_lists_every_option_in_order():
    rows = re.findall(r"^\| `(\w+)` \|", section("Options (`[eval.lm_eval]`)"), flags=re.MULTILINE)
    assert rows == [field.name for field in attrs.fields(LmEvalOptions)]


def test_the_switch_table_lists_every_switch_of_forge_eval():
    rows = re.findall(r"^\| `(--[\w-]+)", section("`forge eval`: tasks on a checkpoint"), flags=re.MULTILINE)
    parser = build_parser()
    commands = next(action for action in parser._actions if action.dest == "command")
    switches = [
        action.option_strings[0]
        for action in commands.choices["eval"]._actions
        if action.option_strings and getattr(action.container, "title", None) != "plugin switches"
        if action.dest != "help"
    ]
    assert rows == switches


def test_the_example_task_is_the_tests_multiple_choice_task():
    assert block("yaml", "task: forge_test_choice") == Path(CHOICE).read_text()
    line = re.search(r"like\n`(\{.*?\})`", TEXT).group(1)
    assert (TASKS / "data" / "choice.jsonl").read_text().splitlines()[0] == line


def mask(table: str) -> list[str]:
    """The table's rows without their numbers (which depend on the model), and without padding."""
    rows = []
    for line in table.splitlines():
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.split("|")[1:-1]]
            rows.append("|".join([*cells[:6], cells[7]] if not set(cells[0]) <= {"-"} else ["---"]))
    return rows


def test_the_printed_table_and_line_are_what_forge_eval_prints(make_run, tmp_path, capsys, monkeypatch):
    run_dir = make_run("bytes")
    output = tmp_path / "step.json"
    monkeypatch.chdir(TASKS)
    args = ["--tasks", "choice.yaml,complete.yaml,rolling.yaml", "--output", str(output)]
    assert main(["eval", str(run_dir), *args]) == 0
    printed = capsys.readouterr().out
    shown = block("", "|       Tasks       |")

    assert mask(printed) == mask(shown)
    assert printed.endswith(f"wrote the results of step 2 to {output}\n")
    assert re.search(r"^wrote the results of step 1 to runs/tiny/eval/step_1\.json$", shown, flags=re.MULTILINE)


def test_the_message_without_the_plugin_is_the_one_forge_eval_prints(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_main, "plugin_manager", lambda args: PluginManager(PluginSettings(), entry_points=False))
    assert main(["eval", str(tmp_path), "--tasks", "choice.yaml"]) == 2
    assert capsys.readouterr().err == block("", "forge: error: forge eval is a command of")


@pytest.mark.parametrize("name", ["lm_eval"])
def test_the_plugin_and_evaluator_names_are_the_registered_ones(name):
    plugin = PluginManager(PluginSettings(allow=(name,))).plugin(name)
    assert (plugin.distribution, plugin.components) == ("forge-lm-eval", {"evaluators": [name]})
    assert plugin.commands == ["eval"]
    assert f"the plugin `{name}` (distribution `forge-lm-eval`), which registers the\nevaluator `{name}`" in TEXT
