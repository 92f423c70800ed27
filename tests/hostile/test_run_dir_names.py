"""Run directory names that would hurt when printed or written: a terminal escape (a fake red
error line on the user's screen), a line break, a NUL, bytes that are not UTF-8. Each is refused
by the config, shown escaped, before anything is written."""

from __future__ import annotations

import pytest
from _hostile import Case, Outcome, Workspace, case_params

TRAIN = ("train", "{tiny}", "--train.max_steps=2")
CONTROL = r"forge: error: \[train\] output_dir: holds a control character \('{}': a NUL, a terminal escape, "


def nothing_written(ws: Workspace, outcome: Outcome) -> None:
    assert sorted(p.name for p in ws.root.iterdir()) == ["config.toml"] or not list(ws.root.iterdir())
    assert "\x1b" not in outcome.stderr
    assert "\x00" not in outcome.stderr


def config_file(output_dir: str):
    def setup(ws: Workspace) -> None:
        (ws.root / "config.toml").write_text(f'[train]\noutput_dir = "{output_dir}"\n')

    return setup


CASES = [
    Case(
        "output-dir-with-a-terminal-escape",
        (*TRAIN, "--train.output_dir=run\x1b[31m\rforge: error: disk on fire\x1b[0m"),
        2,
        CONTROL.format(r"run\\x1b\[31m\\rforge: error: disk on fire\\x1b\[0m"),
        check=nothing_written,
    ),
    Case(
        "output-dir-with-a-line-break",
        (*TRAIN, "--train.output_dir=run\nforge: note: all fine"),
        2,
        CONTROL.format(r"run\\nforge: note: all fine"),
        check=nothing_written,
    ),
    Case(
        "output-dir-not-utf-8",
        (*TRAIN, "--train.output_dir=run-\udcff\udcfe"),  # the bytes 0xff 0xfe on the command line
        2,
        r"forge: error: \[train\] output_dir: is not valid UTF-8 \('run-\\udcff\\udcfe'\); name the run directory",
        check=nothing_written,
    ),
    Case(
        "output-dir-with-a-nul",
        ("train", "config.toml", "{tiny}", "--train.max_steps=2"),
        2,
        CONTROL.format(r"run\\x00x"),
        setup=config_file(r"run\u0000x"),
        check=nothing_written,
    ),
    Case(
        "config-validate-output-dir-with-an-escape",
        ("config", "validate", "--train.output_dir=\x1b]0;pwned\x07run"),
        2,
        CONTROL.format(r"\\x1b\]0;pwned\\x07run"),
        check=nothing_written,
    ),
]


@pytest.mark.parametrize("case", case_params(CASES))
def test_case(case, run_case):
    run_case(case)
