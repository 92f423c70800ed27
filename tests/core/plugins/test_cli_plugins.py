"""What the ``forge`` command shows about plugins, run as users run it (a fresh interpreter).

Each test here starts a subprocess, so only claims visible at the command line live here;
the details are tested in-process in the other files.
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from forge_lm.plugins import PluginManager, PluginSettings

FORGE_VERSION = importlib.metadata.version("forge-lm")
WIDE = {"COLUMNS": "400"}  # no table cell is folded, so rows can be read back exactly
BLOCKED = "blocked by FORGE_LM_BLOCK_PLUGINS or --block-plugin"
AUTOLOAD_OFF = "plugin autoloading is off (FORGE_LM_DISABLE_PLUGIN_AUTOLOAD or --no-plugin-autoload)"
NOT_ALLOWED = "not in the plugin allowlist (FORGE_LM_PLUGINS or --plugins)"


def quoted(names: list[str]) -> str:
    """Names as a message lists them: ``'a', 'b'``."""
    return ", ".join(f"'{name}'" for name in names)


def table_rows(stdout: str) -> list[list[str]]:
    """The cells of each one-line row of the ``list-plugins`` table."""
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in stdout.splitlines() if line.startswith("│")]


def listed(result) -> dict[str, dict]:
    return {p["name"]: p for p in json.loads(result.stdout)["plugins"]}


@pytest.fixture
def broken_plugins(install_plugin, write_module) -> tuple[str, ...]:
    """One installed plugin per way of being broken; returns their names."""
    install_plugin("forge-raises", 'raise RuntimeError("boom")')
    install_plugin("forge-nodep", "import forge_missing_dependency")
    install_plugin(
        "forge-hookfail",
        """
        @hookimpl
        def forge_lm_register_losses(register):
            raise ValueError("needs a GPU")
        """,
    )
    install_plugin(
        "forge-typo",
        """
        @hookimpl
        def forge_lm_register_optimizer(register):
            pass
        """,
    )
    install_plugin("forge-undecorated", "def forge_lm_configur(config):\n    pass\n")
    install_plugin(
        "forge-badname",
        """
        @hookimpl
        def forge_lm_register_losses(register):
            register("Bad:Name", "forge_badname_impl:build", description="Invalid name")
        """,
    )
    return ("raises", "nodep", "hookfail", "typo", "undecorated", "badname")


def test_list_plugins_shows_each_broken_plugin_with_its_error_and_exits_0(forge_cli, broken_plugins, builtin_names):
    result = forge_cli("--plugins", ",".join(broken_plugins), "list-plugins", env=WIDE)

    assert (result.returncode, result.stderr) == (0, "")
    rows = table_rows(result.stdout)
    for row in [
        ["raises", "forge-raises", "1.0", "broken: import failed: RuntimeError: boom", "-"],
        [
            "nodep",
            "forge-nodep",
            "1.0",
            "broken: import failed: ModuleNotFoundError: No module named 'forge_missing_dependency'",
            "-",
        ],
        ["hookfail", "forge-hookfail", "1.0", "broken: forge_lm_register_losses failed: ValueError: needs a GPU", "-"],
        [
            "typo",
            "forge-typo",
            "1.0",
            "broken: implements unknown hook 'forge_lm_register_optimizer'. "
            "Did you mean 'forge_lm_register_optimizers'?",
            "-",
        ],
        [
            "undecorated",
            "forge-undecorated",
            "1.0",
            "broken: implements unknown hook 'forge_lm_configur'. Did you mean 'forge_lm_configure'?",
            "-",
        ],
        [
            "badname",
            "forge-badname",
            "1.0",
            "broken: component name 'Bad:Name' is invalid: use lower-case letters, digits, '_', '.' or '-' "
            "(':' is reserved for 'distribution:name')",
            "-",
        ],
        ["core.optimizers", "forge-lm", FORGE_VERSION, "ok", f"optimizers: {', '.join(builtin_names('optimizers'))}"],
    ]:
        assert row in rows


def test_list_plugins_json_gives_the_same_data_as_the_plugin_manager(forge_cli, broken_plugins, install_plugin):
    install_plugin("forge-old", api='">=2,<3"')
    names = (*broken_plugins, "old", "zzz-missing")

    result = forge_cli("--plugins", ",".join(names), "list-plugins", "--json")

    warning = "the plugin allowlist names 'zzz-missing', which is not an installed plugin."
    assert (result.returncode, result.stderr) == (0, f"forge: warning: {warning}\n")
    manager = PluginManager(PluginSettings(allow=names))
    assert json.loads(result.stdout) == {
        "plugins": [p.as_dict() for p in manager.plugins],
        "warnings": [warning],
    }
    assert listed(result)["raises"] == {
        "name": "raises",
        "distribution": "forge-raises",
        "version": "1.0",
        "module": "forge_raises",
        "builtin": False,
        "status": "broken",
        "reason": "import failed: RuntimeError: boom",
        "api_range": None,
        "components": {},
        "commands": [],
    }


def test_list_plugins_shows_an_incompatible_plugin_with_its_reason_and_components(forge_cli, install_plugin):
    install_plugin(
        "forge-old",
        """
        @hookimpl
        def forge_lm_register_losses(register):
            register("old_loss", "forge_old_impl:build", description="From the future")
        """,
        api='">=2,<3"',
        version="3.0",
    )

    result = forge_cli("--plugins", "old", "list-plugins", env=WIDE)

    assert (result.returncode, result.stderr) == (0, "")
    assert [
        "old",
        "forge-old",
        "3.0",
        "incompatible: supports plugin API >=2,<3 but this core provides 1.4; install a release of the plugin "
        "made for this core, or a core that provides API >=2,<3",
        "losses: old_loss",
    ] in table_rows(result.stdout)


def test_config_naming_a_component_of_a_broken_known_plugin_names_its_distribution_version_and_fix(
    forge_cli, install_plugin, builtin_names
):
    install_plugin(
        "forge-optim-muon",
        "import forge_missing_dependency",
        version="9.9",
        module="fake_muon",
        entry_points={"muon": "fake_muon"},
    )

    result = forge_cli("--plugins", "muon", "config", "validate", "--optimizer.name=muon")

    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr == (
        "forge: error: [optimizer] name = 'muon': unknown optimizer 'muon'.\n"
        f"Available optimizers: {quoted(builtin_names('optimizers'))}.\n"
        f"Installed plugins offering optimizers: plugin 'core.optimizers' (forge-lm {FORGE_VERSION}).\n"
        "plugin 'muon' (forge-optim-muon 9.9) is installed but broken: import failed: ModuleNotFoundError: "
        "No module named 'forge_missing_dependency'. Fix: reinstall it with its dependencies "
        "(pip install --force-reinstall forge-optim-muon) or remove it (pip uninstall forge-optim-muon).\n"
    )


def test_config_naming_a_component_a_broken_plugin_might_provide_lists_it_with_the_fix(
    forge_cli, install_plugin, builtin_names
):
    install_plugin("forge-lamb", 'raise RuntimeError("boom")', version="0.7")

    result = forge_cli("--plugins", "lamb", "config", "validate", "--optimizer.name=lamb")

    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(
        "forge: error: [optimizer] name = 'lamb': unknown optimizer 'lamb'.\n"
        f"Available optimizers: {quoted(builtin_names('optimizers'))}.\n"
        f"Installed plugins offering optimizers: plugin 'core.optimizers' (forge-lm {FORGE_VERSION}).\n"
        "These installed plugins are not loaded and might provide it:\n"
    )
    assert (
        "\n  plugin 'lamb' (forge-lamb 0.7) is installed but broken: import failed: RuntimeError: boom. "
        "Fix: reinstall it with its dependencies (pip install --force-reinstall forge-lamb) "
        "or remove it (pip uninstall forge-lamb).\n"
    ) in result.stderr


def test_config_naming_a_component_of_an_incompatible_plugin_gives_the_reason(forge_cli, install_plugin):
    install_plugin(
        "forge-old",
        """
        @hookimpl
        def forge_lm_register_optimizers(register):
            register("old_opt", "forge_old_impl:build", description="From the future")
        """,
        api=None,
    )

    result = forge_cli("--plugins", "old", "config", "validate", "--optimizer.name=old_opt")

    assert result.returncode == 2
    assert result.stderr == (
        "forge: error: [optimizer] name = 'old_opt': optimizer 'old_opt' comes from plugin 'old' (forge-old 1.0), "
        'which is incompatible: declares no plugin API range; add FORGE_LM_PLUGIN_API = ">=1,<2" to module '
        "'forge_old' (this core provides plugin API 1.4).\n"
    )


def test_broken_plugin_does_not_stop_a_config_that_does_not_need_it(forge_cli, broken_plugins):
    result = forge_cli("--plugins", ",".join(broken_plugins), "config", "validate")

    assert (result.returncode, result.stdout.splitlines()[0], result.stderr) == (0, "the default config is valid.", "")


def test_autoload_variable_disables_third_party_plugins_and_keeps_builtins(forge_cli, install_plugin):
    install_plugin("forge-fake")

    result = forge_cli("list-plugins", "--json", env={"FORGE_LM_DISABLE_PLUGIN_AUTOLOAD": "1"})

    assert result.returncode == 0
    plugins = listed(result)
    assert {(p["status"], p["reason"]) for p in plugins.values() if not p["builtin"]} == {("disabled", AUTOLOAD_OFF)}
    assert {p["status"] for p in plugins.values() if p["builtin"]} == {"ok"}
    assert plugins["fake"]["status"] == "disabled"


def test_invalid_autoload_variable_is_a_usage_error_without_traceback(forge_cli):
    result = forge_cli("list-plugins", env={"FORGE_LM_DISABLE_PLUGIN_AUTOLOAD": "maybe"})

    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "forge: error: FORGE_LM_DISABLE_PLUGIN_AUTOLOAD='maybe' is not a boolean; "
        "set it to 1 (disable autoloading) or 0 (load every installed plugin).\n"
    )


def test_allowlist_variable_loads_only_the_named_plugins_even_with_autoload_off(forge_cli, install_plugin):
    install_plugin("forge-fake")
    install_plugin("forge-other")

    result = forge_cli(
        "list-plugins", "--json", env={"FORGE_LM_PLUGINS": "fake", "FORGE_LM_DISABLE_PLUGIN_AUTOLOAD": "1"}
    )

    assert (result.returncode, result.stderr) == (0, "")
    plugins = listed(result)
    assert [name for name, p in plugins.items() if p["status"] == "ok" and not p["builtin"]] == ["fake"]
    assert (plugins["other"]["status"], plugins["other"]["reason"]) == ("disabled", NOT_ALLOWED)


def test_blocklist_variable_can_block_a_builtin_and_then_its_component_is_refused(forge_cli):
    # Third-party plugins off, so that no installed plugin (forge-optim-muon) offers an optimizer.
    env = {"FORGE_LM_BLOCK_PLUGINS": "core.optimizers", "FORGE_LM_DISABLE_PLUGIN_AUTOLOAD": "1"}
    result = forge_cli("config", "validate", env=env)

    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(
        "forge: error: [optimizer] name = 'adamw': unknown optimizer 'adamw'.\n"
        "Available optimizers: (none).\n"
        "These installed plugins are not loaded and might provide it:\n"
        f"  plugin 'core.optimizers' (forge-lm {FORGE_VERSION}) is installed but disabled: {BLOCKED}. "
        "Enable it to use its components.\n"
    )


def test_no_plugin_autoload_flag_disables_third_party_plugins(forge_cli, install_plugin):
    install_plugin("forge-fake")

    result = forge_cli("--no-plugin-autoload", "list-plugins", "--json")

    assert result.returncode == 0
    plugins = listed(result)
    assert (plugins["fake"]["status"], plugins["fake"]["reason"]) == ("disabled", AUTOLOAD_OFF)
    assert {p["status"] for p in plugins.values() if p["builtin"]} == {"ok"}


def test_plugins_flag_loads_exactly_the_listed_plugins_and_overrides_the_variable(forge_cli, install_plugin):
    install_plugin("forge-aaa")
    install_plugin("forge-bbb")
    install_plugin("forge-ccc")

    result = forge_cli("--plugins", "aaa,bbb", "list-plugins", "--json", env={"FORGE_LM_PLUGINS": "ccc"})

    assert (result.returncode, result.stderr) == (0, "")
    plugins = listed(result)
    assert [name for name, p in plugins.items() if p["status"] == "ok" and not p["builtin"]] == ["aaa", "bbb"]
    assert (plugins["ccc"]["status"], plugins["ccc"]["reason"]) == ("disabled", NOT_ALLOWED)


def test_block_plugin_flag_is_repeatable_and_adds_to_the_variable(forge_cli, install_plugin):
    install_plugin("forge-fake")

    result = forge_cli(
        "--block-plugin",
        "core.losses",
        "--block-plugin=fake",
        "list-plugins",
        "--json",
        env={"FORGE_LM_BLOCK_PLUGINS": "core.tokenizers"},
    )

    assert (result.returncode, result.stderr) == (0, "")
    plugins = listed(result)
    assert {name for name, p in plugins.items() if p["reason"] == BLOCKED} == {"core.losses", "fake", "core.tokenizers"}
    assert plugins["core.optimizers"]["status"] == "ok"


def test_block_plugin_flag_on_a_builtin_makes_a_config_using_its_component_fail(forge_cli):
    result = forge_cli("--block-plugin", "core.optimizers", "config", "validate")

    assert result.returncode == 2
    assert (
        f"plugin 'core.optimizers' (forge-lm {FORGE_VERSION}) is installed but disabled: {BLOCKED}. "
        "Enable it to use its components."
    ) in result.stderr
    assert "Traceback" not in result.stderr


def test_switch_naming_a_plugin_that_is_not_installed_warns_with_a_suggestion(forge_cli, install_plugin):
    install_plugin("forge-fake")

    result = forge_cli("--plugins", "fak", "--block-plugin", "core.optimiser", "list-plugins", "--json")

    assert result.returncode == 0
    assert result.stderr == (
        "forge: warning: the plugin blocklist names 'core.optimiser', which is not an installed plugin. "
        "Did you mean 'core.optimizers'?\n"
        "forge: warning: the plugin allowlist names 'fak', which is not an installed plugin. Did you mean 'fake'?\n"
    )
    assert json.loads(result.stdout)["warnings"] == [
        line.removeprefix("forge: warning: ") for line in result.stderr.splitlines()
    ]


def test_plugin_switch_after_the_config_command_works_as_before_it(forge_cli):
    # Found by these tests: `forge config validate --block-plugin=core.optimizers` is read as a
    # config override and fails with "[block-plugin]: unknown section".
    result = forge_cli("config", "validate", "--block-plugin=core.optimizers")

    assert result.returncode == 2
    assert "unknown section" not in result.stderr
    assert f"is installed but disabled: {BLOCKED}." in result.stderr
