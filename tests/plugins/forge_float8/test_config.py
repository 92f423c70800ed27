"""`[transforms.float8]`: its options, the combinations the plugin refuses, and what a run
without the plugin says."""

from __future__ import annotations

import pytest

from forge_float8.options import Float8Options
from forge_lm.cli import _main
from forge_lm.cli._main import main
from forge_lm.config import load_config
from forge_lm.errors import ConfigError
from forge_lm.plugins import PluginManager, PluginSettings

from .conftest import DEBUG_CONFIG, REFUSED_FP16, REFUSED_ROWWISE_ALL_GATHER, REFUSED_TP


def configured(manager, *overrides):
    """The shipped float8 config with ``overrides``, checked by every plugin's configure hook."""
    config = load_config(DEBUG_CONFIG, list(overrides), manager.registry)
    manager.configure(config)
    return config


def test_the_shipped_config_enables_float8_with_the_tensorwise_recipe(float8_manager):
    config = configured(float8_manager)
    assert config.transforms["float8"].options == Float8Options(enabled=True, recipe="tensorwise")


def test_the_table_may_name_the_distribution_too(float8_manager, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[transforms."forge-float8:float8"]\nenabled = true\nrecipe = "rowwise"\n')
    config = load_config(path, [], float8_manager.registry)
    float8_manager.configure(config)
    (chosen,) = config.transforms.values()
    assert chosen.options == Float8Options(enabled=True, recipe="rowwise")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            ["--transforms.float8.recipe=rowwise", "--transforms.float8.fsdp_float8_all_gather=true"],
            REFUSED_ROWWISE_ALL_GATHER,
            id="rowwise-all-gather",
        ),
        pytest.param(
            [
                "--transforms.float8.enabled=false",
                "--transforms.float8.recipe=rowwise",
                "--transforms.float8.fsdp_float8_all_gather=true",
            ],
            REFUSED_ROWWISE_ALL_GATHER,
            id="rowwise-all-gather-while-disabled",
        ),
        pytest.param(["--distributed.tp=2"], REFUSED_TP, id="tensor-parallel"),
        pytest.param(["--train.precision=fp16"], REFUSED_FP16, id="fp16"),
    ],
)
def test_combinations_torchao_or_the_plugin_cannot_do_are_refused_naming_the_fix(float8_manager, overrides, message):
    with pytest.raises(ConfigError) as caught:
        configured(float8_manager, *overrides)
    assert str(caught.value) == message


def test_fp16_is_refused_at_validation_naming_both_settings(float8_manager):
    with pytest.raises(ConfigError, match=r"^\[transforms.float8\] enabled = true with \[train\] precision = 'fp16'"):
        configured(float8_manager, "--train.precision=fp16")
    configured(float8_manager, "--train.precision=fp16", "--transforms.float8.enabled=false")  # off: no concern


def test_tensor_parallelism_without_float8_is_not_the_plugins_business(float8_manager):
    configured(float8_manager, "--distributed.tp=2", "--transforms.float8.enabled=false")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--transforms.float8.recipe=delayed", r"\[transforms.float8\] recipe: .*'tensorwise'"),
        ("--transforms.float8.include=[' ']", r"\[transforms.float8\] include: patterns must not be empty"),
        ("--transforms.float8.enable=true", r"\[transforms.float8\] enable: unknown key .*Did you mean 'enabled'"),
    ],
)
def test_bad_options_name_the_table_and_key(float8_manager, override, message):
    with pytest.raises(ConfigError, match=message):
        configured(float8_manager, override)


def test_forge_config_validate_reports_the_refusal_with_exit_2(forge_cli):
    done = forge_cli("config", "validate", str(DEBUG_CONFIG), "--distributed.tp=2")
    assert done.returncode == 2
    assert done.stderr == f"forge: error: {REFUSED_TP}\n"


def test_forge_train_with_the_plugin_blocked_exits_2_naming_the_distribution(forge_cli, tmp_path):
    run_dir = tmp_path / "run"
    done = forge_cli("train", str(DEBUG_CONFIG), "--block-plugin", "float8", f"--train.output_dir={run_dir}")

    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert lines[0] == (
        "forge: error: [transforms.float8]: model transform 'float8' is provided by plugin 'float8' "
        "(forge-float8 0.1.0), which is installed but disabled: blocked by FORGE_LM_BLOCK_PLUGINS or "
        "--block-plugin. Enable it to use its components."
    )
    assert "Traceback" not in done.stderr
    assert not run_dir.exists()


def test_forge_train_with_plugin_autoloading_off_says_so(forge_cli, tmp_path):
    done = forge_cli("--no-plugin-autoload", "train", str(DEBUG_CONFIG), f"--train.output_dir={tmp_path / 'run'}")
    assert done.returncode == 2
    assert done.stderr.startswith(
        "forge: error: [transforms.float8]: model transform 'float8' is provided by plugin 'float8' (forge-float8 "
        "0.1.0), which is installed but disabled: plugin autoloading is off"
    )


def test_forge_train_where_the_plugin_is_not_installed_says_what_to_install(monkeypatch, capsys, tmp_path):
    # What a machine without forge-float8 sees: no installed plugin is found.
    monkeypatch.setattr(_main, "plugin_manager", lambda args: PluginManager(PluginSettings(), entry_points=False))
    run_dir = tmp_path / "run"

    assert main(["train", str(DEBUG_CONFIG), f"--train.output_dir={run_dir}"]) == 2

    err = capsys.readouterr().err
    assert err.startswith("forge: error: [transforms.float8]: unknown model transform 'float8'.\n")
    assert err.endswith("'float8' is provided by the package forge-float8: pip install forge-float8\n")
    assert not run_dir.exists()
