"""The README's transcripts (code blocks starting with ``$ forge``) print what they show."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
TRANSCRIPTS = re.findall(r"```\n\$ (forge [^\n]*)\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_transcripts():
    assert TRANSCRIPTS


@pytest.mark.parametrize(("command", "expected"), TRANSCRIPTS, ids=[c for c, _ in TRANSCRIPTS])
def test_readme_transcript_is_what_forge_prints(command, expected, forge_cli):
    done = forge_cli(*shlex.split(command)[1:], env={"FORGE_LM_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert done.stdout + done.stderr == expected
