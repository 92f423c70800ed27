"""``--checkpoint.keep``: the ``[[checkpoint.keep]]`` retention rules from the command line (a TOML
array of inline tables), and ``forge config show`` printing the retention rules."""

from __future__ import annotations

import tomllib

import pytest

from forge_lm.cli._main import main as forge_main
from forge_lm.config import load_config
from forge_lm.errors import ConfigError

RULES = "[{until_step = 10000, every = 1000}, {every = 5000}]"
AS_TOML = "[[checkpoint.keep]]\nuntil_step = 10000\nevery = 1000\n[[checkpoint.keep]]\nevery = 5000\n"


def test_the_override_gives_the_rules_a_config_file_gives(manager, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(AS_TOML)
    from_file = load_config(path, [], manager.registry).checkpoint.keep
    from_cli = load_config(None, [f"--checkpoint.keep={RULES}"], manager.registry).checkpoint.keep
    assert from_cli == from_file
    assert [(rule.until_step, rule.every) for rule in from_cli] == [(10000, 1000), (None, 5000)]


def test_the_override_replaces_the_files_rules(manager, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(AS_TOML)
    keep = load_config(path, ["--checkpoint.keep=[{every = 7}]"], manager.registry).checkpoint.keep
    assert [(rule.until_step, rule.every) for rule in keep] == [(None, 7)]
    assert load_config(path, ["--checkpoint.keep=[]"], manager.registry).checkpoint.keep == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "five",
            r"\[checkpoint\] keep: expected an array of tables \(\[\[checkpoint.keep\]\]; on the command line "
            r"inline tables, --checkpoint.keep='\[\{every = ...\}, ...\]'\), got 'five'",
        ),
        ("{every = 5}", r"expected an array of tables .* got '\{every = 5\}'"),
        ("[{every = 5}", r"expected an array of tables .* got '\[\{every = 5\}'"),
        ("[{until_step = 10}]", r"\[checkpoint.keep\[0\]\] every: required, but not set"),
        ("[{every = 0}]", r"\[checkpoint.keep\[0\]\] every: must be > 0, got 0"),
        ("[{every = 5, each = 2}]", r"\[checkpoint.keep\[0\]\] each: unknown key"),
        (
            "[{every = 2}, {until_step = 9, every = 3}]",
            r"only the last \[\[checkpoint.keep\]\] rule may leave until_step",
        ),
    ],
)
def test_a_malformed_override_is_refused_naming_the_key(manager, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"--checkpoint.keep={value}"], manager.registry)


def test_config_show_prints_the_retention_rules(capsys):
    overrides = ["--checkpoint.keep_last_n=2", "--checkpoint.keep_every_n_steps=50", "--checkpoint.keep_best_n=1"]
    code = forge_main(["config", "show", "--no-plugin-autoload", *overrides, f"--checkpoint.keep={RULES}"])
    assert code == 0
    shown = tomllib.loads(capsys.readouterr().out)["checkpoint"]
    assert (shown["keep_last_n"], shown["keep_every_n_steps"], shown["keep_best_n"]) == (2, 50, 1)
    assert (shown["keep_best_metric"], shown["keep_best_mode"]) == ("eval/loss", "min")
    assert shown["keep"] == [{"until_step": 10000, "every": 1000}, {"every": 5000}]
