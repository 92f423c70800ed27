"""A plugin adds a ``forge`` subcommand through forge_lm_register_commands (issue 33): it is parsed,
run with the loaded plugins and listed; a broken registration makes the plugin broken with the
reason, and a broken command fails naming its plugin (exit 4), never with a traceback."""

from __future__ import annotations

import json
import sys
import types

import pytest

from forge_lm import hookimpl
from forge_lm.cli import _main
from forge_lm.cli._main import COMMANDS, main
from forge_lm.plugins import PluginManager, PluginSettings, PluginStatus
from forge_lm.plugins._commands import CORE_COMMANDS


class Greet:
    """A command: ``forge greet NAME [--times N]`` prints a greeting per time, exits with 3."""

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--times", type=int, default=1)

    def run(self, args, plugins):
        plugin = plugins.plugin("greeter")
        for _ in range(args.times):
            print(f"hello {args.name} from {plugin.distribution}")
        return 3


class Raising(Greet):
    def run(self, args, plugins):
        raise ValueError("boom")


class BadArguments(Greet):
    def add_arguments(self, parser):
        raise RuntimeError("no parser for me")


def _plugin(register_commands):
    class Plugin:
        FORGE_LM_PLUGIN_API = ">=1.1,<2"

        @hookimpl
        def forge_lm_register_commands(self, register):
            register_commands(register)

    return Plugin()


def _manager(*plugins: tuple[str, object]) -> PluginManager:
    manager = PluginManager(PluginSettings(autoload=False), entry_points=False)
    for name, plugin in plugins:
        manager.add_plugin(plugin, name, distribution=f"forge-{name}", version="2.0")
    return manager


@pytest.fixture
def with_plugins(monkeypatch):
    """Run ``forge`` with these plugins loaded (in place of the installed ones)."""

    def use(*plugins: tuple[str, object]) -> PluginManager:
        manager = _manager(*plugins)
        monkeypatch.setattr(_main, "plugin_manager", lambda args: manager)
        return manager

    return use


def greeter(command=None):
    return ("greeter", _plugin(lambda register: register("greet", command or Greet(), description="say hello")))


def test_a_plugins_command_is_parsed_and_run_with_the_loaded_plugins(with_plugins, capsys):
    with_plugins(greeter())

    assert main(["greet", "Ada", "--times", "2", "--block-plugin", "nothing"]) == 3

    assert capsys.readouterr().out == "hello Ada from forge-greeter\nhello Ada from forge-greeter\n"


def test_forge_help_and_list_plugins_show_a_plugins_command(with_plugins, capsys):
    with_plugins(greeter())
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert any(line.split() == ["greet", "say", "hello"] for line in capsys.readouterr().out.splitlines())

    assert main(["list-plugins", "--json"]) == 0
    listed = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    assert listed["greeter"]["commands"] == ["greet"]


def test_a_plugin_commands_own_mistakes_are_usage_errors(with_plugins, capsys):
    with_plugins(greeter())
    assert main(["greet"]) == 2
    assert capsys.readouterr().err == (
        "forge: error: the following arguments are required: name (see 'forge greet --help')\n"
    )
    assert main(["greet", "Ada", "--section.key=1"]) == 2
    assert capsys.readouterr().err == "forge: error: unrecognized arguments: --section.key=1.\n"


@pytest.mark.parametrize(
    ("command", "problem"),
    [
        (Raising(), "raised in run() of its command 'greet': ValueError: boom"),
        (BadArguments(), "raised in add_arguments() of its command 'greet': RuntimeError: no parser for me"),
        (
            object(),
            "registered command 'greet' as object, without add_arguments() and run() (forge_lm.components.Command)",
        ),
        (
            "forge_greeter_nowhere:COMMAND",
            "cannot import its command 'greet' ('forge_greeter_nowhere:COMMAND'): ModuleNotFoundError: No module "
            "named 'forge_greeter_nowhere'",
        ),
    ],
    ids=["run-raises", "add-arguments-raises", "no-methods", "import-fails"],
)
def test_a_broken_command_fails_naming_its_plugin_with_exit_4(with_plugins, capsys, command, problem):
    with_plugins(greeter(command))

    assert main(["greet", "Ada"]) == 4

    assert capsys.readouterr().err == (
        f"forge: error: plugin 'greeter' (forge-greeter 2.0) {problem}. This is a bug in the plugin: report it to its "
        "authors, or run without it (--block-plugin greeter).\n"
    )


def test_a_command_returning_no_exit_code_is_the_plugins_failure(with_plugins, capsys):
    returns_text = types.SimpleNamespace(add_arguments=lambda parser: None, run=lambda args, plugins: "done")
    with_plugins(greeter(returns_text))
    assert main(["greet"]) == 4
    assert "returned str from run() of its command 'greet', not an exit code" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("register", "reason"),
    [
        (
            lambda register: register("train", Greet(), description="x"),
            "forge_lm_register_commands failed: PluginError: registers command 'train', which is a command of the "
            "core; choose another name",
        ),
        (
            lambda register: register("Greet Me", Greet(), description="x"),
            "forge_lm_register_commands failed: PluginError: command name 'Greet Me' is invalid: use lower-case "
            "letters and digits, words joined by '-' (export-onnx)",
        ),
        (
            lambda register: register("greet", Greet()),
            "forge_lm_register_commands failed: PluginError: command 'greet': description must be one non-empty "
            "line (it is the command's --help)",
        ),
        (
            lambda register: register("greet", "no_colon_here", description="x"),
            "forge_lm_register_commands failed: PluginError: command 'greet': 'no_colon_here' is not a "
            "'module:attribute' string",
        ),
        (
            lambda register: [register("greet", Greet(), description="x") for _ in range(2)],
            "registers command 'greet' twice",
        ),
    ],
    ids=["core-name", "bad-name", "no-description", "bad-target", "twice"],
)
def test_a_broken_registration_makes_the_plugin_broken_with_the_reason(register, reason):
    manager = _manager(("greeter", _plugin(register)))
    plugin = manager.plugin("greeter")
    assert (plugin.status, plugin.reason) == (PluginStatus.BROKEN, reason)
    assert manager.commands == {}


def test_a_command_name_belongs_to_the_plugin_that_registered_it_first():
    manager = _manager(greeter(), ("copycat", _plugin(lambda r: r("greet", Greet(), description="me too"))))
    copycat = manager.plugin("copycat")
    assert (copycat.status, copycat.reason) == (
        PluginStatus.BROKEN,
        "registers command 'greet', which plugin 'greeter' (forge-greeter 2.0) registered first; a command name "
        "belongs to one plugin",
    )
    assert manager.commands["greet"].plugin.name == "greeter"


def test_an_unknown_command_names_the_commands(with_plugins, capsys):
    with_plugins(greeter())
    assert main(["gret"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("forge: error: argument COMMAND: invalid choice: 'gret'. Did you mean 'greet'? Commands: ")
    assert "greet, import-hf" in err


def test_a_core_command_imports_only_its_own_module(monkeypatch):
    for module in COMMANDS.values():
        monkeypatch.delitem(sys.modules, module, raising=False)
    assert main(["config", "show", "--no-plugin-autoload"]) == 0
    imported = {name for name, module in COMMANDS.items() if module in sys.modules}
    assert imported == {"config"}


def test_the_core_commands_plugins_may_not_take_are_the_clis():
    assert set(CORE_COMMANDS) == set(COMMANDS)


def test_the_command_in_writing_a_plugin_runs_as_written(with_plugins, capsys):
    from pathlib import Path

    from forge_lm.testing.markdown import code_block

    doc = Path(__file__).resolve().parents[3] / "docs" / "writing-a-plugin.md"
    module = types.ModuleType("forge_hello.plugin")
    exec(code_block(doc.read_text(encoding="utf-8"), "python", "# forge_hello/plugin.py"), module.__dict__)
    manager = with_plugins(("hello", module))
    assert manager.plugin("hello").status is PluginStatus.OK

    assert main(["hello", "Ada", "--times", "2"]) == 0

    greeting = f"hello Ada, from {len(manager.plugins)} plugins\n"
    assert capsys.readouterr().out == greeting * 2


def test_forge_help_leaves_out_a_command_that_cannot_be_imported_with_a_warning(with_plugins, capsys):
    with_plugins(greeter("forge_greeter_nowhere:COMMAND"))
    with pytest.raises(SystemExit):
        main(["--help"])
    out, err = capsys.readouterr()
    assert "greet" not in out
    assert "list-plugins" in out
    assert err.startswith("forge: warning: plugin 'greeter' (forge-greeter 2.0) cannot import its command 'greet'")
