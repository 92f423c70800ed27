"""``forge config show|validate`` and the command line around them.

Subprocess tests (``forge_cli``) check what a user sees: exit code, stdout, stderr. Cheaper
in-process tests call :func:`forge_lm.cli.main` for the rest.
"""

from __future__ import annotations

import re
import tomllib

from forge_lm.cli import main
from forge_lm.config import load_config, to_toml
from forge_lm.plugins import PLUGIN_API_VERSION, PluginManager, PluginSettings, core_version

RUN_TOML = """
[model]
n_kv_heads = 2

[optimizer]
lr = 1e-3
"""

STRICT_PLUGIN = """
from forge_lm import ConfigError, hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"

@hookimpl
def forge_lm_configure(config):
    if config.train.max_steps > 1000:
        raise ConfigError(f"[train] max_steps: the strict plugin allows at most 1000, got {config.train.max_steps}.")
"""


# -- subprocess: what a user sees -------------------------------------------------------------


def test_validate_without_a_file_accepts_the_defaults_and_exits_0(forge_cli):
    result = forge_cli("config", "validate")
    valid, estimate = result.stdout.splitlines()
    assert (result.returncode, valid, result.stderr) == (0, "the default config is valid.", "")
    assert re.match(r"^estimate: 3\.28M parameters; about \d.* per rank \(weights ", estimate), estimate


def test_validate_a_valid_file_with_an_override_names_the_file_and_exits_0(forge_cli, write_toml):
    path = write_toml(RUN_TOML)
    result = forge_cli("config", "validate", str(path), "--model.n_heads=8")
    assert (result.returncode, result.stdout.splitlines()[0], result.stderr) == (0, f"{path} is valid.", "")


def test_validate_an_invalid_override_exits_2_with_one_error_line_and_no_traceback(forge_cli):
    result = forge_cli("config", "validate", "--optimizer.lr=-1")
    assert (result.returncode, result.stdout, result.stderr) == (
        2,
        "",
        "forge: error: [optimizer] lr: must be > 0, got -1.0.\n",
    )


def test_validate_an_invalid_file_exits_2_naming_the_mistake(forge_cli, write_toml):
    path = write_toml('[model]\nn_heads = "8"\n')
    result = forge_cli("config", "validate", str(path))
    assert (result.returncode, result.stderr) == (
        2,
        "forge: error: [model] n_heads: expected an integer, got string '8'.\n",
    )
    assert "Traceback" not in result.stderr


def test_show_prints_toml_with_the_file_and_the_override_applied(forge_cli, write_toml):
    path = write_toml(RUN_TOML)
    result = forge_cli("config", "show", str(path), "--model.n_heads=8")
    assert (result.returncode, result.stderr) == (0, "")
    shown = tomllib.loads(result.stdout)
    assert (shown["model"]["n_heads"], shown["model"]["n_kv_heads"]) == (8, 2)
    assert shown["optimizer"] == {
        "name": "adamw",
        "lr": 1e-3,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
        "decay_embeddings": False,
        "implementation": "auto",
    }


def test_show_prints_exactly_the_dump_of_the_resolved_config(forge_cli, write_toml):
    path = write_toml(RUN_TOML)
    result = forge_cli("config", "show", str(path), "--train.max_steps=7")
    expected = to_toml(load_config(path, ["--train.max_steps=7"], PluginManager(PluginSettings()).registry))
    assert result.returncode == 0
    assert result.stdout.startswith(expected)
    # then, as comments, what the run derives from values left unset (issue 36: vocab_size was missing)
    derived = result.stdout[len(expected) :]
    assert derived == (
        "\n# Unset above, derived when the run starts:\n"
        "#   [model] vocab_size = 257 (the tokenizer's vocabulary)\n"  # the bytes tokenizer: 256 bytes and eos
        "#   [model] head_dim = 64 (dim / n_heads)\n"  # 256 / 4; n_kv_heads is set in RUN_TOML
    ), derived
    assert tomllib.loads(result.stdout) == tomllib.loads(expected)


def test_show_names_what_it_cannot_derive_and_every_unset_size(forge_cli):
    result = forge_cli("config", "show", "--tokenizer.name=hf", "--tokenizer.path=missing.json")
    assert result.returncode == 0
    tail = result.stdout.split("# Unset above, derived when the run starts:\n")[1]
    assert tail.startswith("#   [model] vocab_size = the tokenizer's vocabulary (not read here: [tokenizer] path:")
    assert "#   [model] n_kv_heads = 4 (n_heads: multi-head attention)\n" in tail
    assert tail.endswith("#   [model] head_dim = 64 (dim / n_heads)\n")


def test_a_plugins_configure_hook_rejection_makes_validate_exit_2(forge_cli, fake_site):
    fake_site.install("forge-strict", STRICT_PLUGIN)
    rejected = forge_cli("config", "validate", "--train.max_steps=5000")
    assert (rejected.returncode, rejected.stdout, rejected.stderr) == (
        2,
        "",
        "forge: error: [train] max_steps: the strict plugin allows at most 1000, got 5000.\n",
    )
    accepted = forge_cli("config", "validate", "--train.max_steps=500")
    assert (accepted.returncode, accepted.stdout.splitlines()[0]) == (0, "the default config is valid.")


def test_an_unknown_component_with_autoloading_off_says_the_installed_plugin_is_disabled(forge_cli):
    result = forge_cli("--no-plugin-autoload", "config", "validate", "--optimizer.name=muon")
    muon = PluginManager(PluginSettings()).plugin("muon")
    optimizers = ", ".join(
        f"'{name}'" for name in PluginManager(PluginSettings(autoload=False)).registry.names("optimizers")
    )
    assert (result.returncode, result.stderr) == (
        2,
        f"forge: error: [optimizer] name = 'muon': optimizer 'muon' is provided by plugin 'muon' (forge-optim-muon "
        f"{muon.version}), which is installed but disabled: plugin autoloading is off "
        "(FORGE_LM_DISABLE_PLUGIN_AUTOLOAD or --no-plugin-autoload). Enable it to use its components.\n"
        f"Available optimizers: {optimizers}.\n"
        f"Installed plugins offering optimizers: plugin 'core.optimizers' (forge-lm {core_version()}).\n",
    )


def test_an_override_without_dashes_is_reported_as_a_malformed_override_not_a_missing_file(forge_cli):
    result = forge_cli("config", "validate", "model.n_heads=8")
    assert (result.returncode, result.stderr) == (
        2,
        "forge: error: 'model.n_heads=8' is not an override; write --section.key=value (e.g. --model.n_heads=8).\n",
    )


def test_config_without_an_action_exits_2_with_a_hint(forge_cli):
    result = forge_cli("config")
    assert (result.returncode, result.stdout, result.stderr) == (
        2,
        "",
        "forge: error: say what to do with the config: 'forge config show', 'forge config validate' or "
        "'forge config reference'.\n",
    )


def test_an_unrecognized_argument_to_list_plugins_exits_2(forge_cli):
    result = forge_cli("list-plugins", "--bogus")
    assert (result.returncode, result.stdout, result.stderr) == (
        2,
        "",
        "forge: error: unrecognized arguments: --bogus.\n",
    )


def test_version_prints_the_core_version_and_the_plugin_api(forge_cli):
    result = forge_cli("--version")
    assert (result.returncode, result.stdout) == (
        0,
        f"forge {core_version()} (distribution forge-lm, plugin API {PLUGIN_API_VERSION})\n",
    )


def test_help_exits_0_and_lists_the_commands(forge_cli):
    result = forge_cli("--help", env={"COLUMNS": "120"})
    assert result.returncode == 0
    assert "list-plugins        show installed plugins and their components" in result.stdout
    assert "config              show or validate a run config" in result.stdout


# -- in process -------------------------------------------------------------------------------


def test_overrides_may_come_before_the_config_file(capsys, write_toml):
    path = write_toml(RUN_TOML)
    assert main(["config", "show", "--model.n_heads=8", str(path)]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert (shown["model"]["n_heads"], shown["model"]["n_kv_heads"]) == (8, 2)


def test_show_with_an_invalid_config_prints_nothing_on_stdout_and_exits_2(capsys):
    assert main(["config", "show", "--model.n_heads=3"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "forge: error: [model] n_heads: dim (256) must be divisible by n_heads (3).\n")


def test_an_override_without_a_value_is_an_unrecognized_argument_with_the_override_form(capsys, write_toml):
    path = write_toml(RUN_TOML)
    assert main(["config", "validate", str(path), "--model.n_heads"]) == 2
    assert capsys.readouterr().err == (
        "forge: error: unrecognized arguments: --model.n_heads. Overrides look like --section.key=value.\n"
    )


def test_a_missing_config_file_exits_2_naming_it(capsys, tmp_path):
    path = tmp_path / "missing.toml"
    assert main(["config", "validate", str(path)]) == 2
    assert capsys.readouterr().err == f"forge: error: config file '{path}' does not exist.\n"


def test_a_config_file_that_is_not_utf8_exits_2_naming_it(capsys, tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[train]\noutput_dir = "caf\u00e9"\n'.encode("latin-1"))
    assert main(["config", "validate", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"forge: error: config file '{path}' ")
