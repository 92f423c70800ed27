"""The README's transcripts (code blocks starting with ``$ forge``) print what they show."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from forge_lm.testing.distributed import torchrun

README = Path(__file__).resolve().parents[1] / "README.md"
TRANSCRIPTS = re.findall(r"```\n\$ (forge [^\n]*)\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_transcripts():
    assert TRANSCRIPTS


@pytest.mark.parametrize(("command", "expected"), TRANSCRIPTS, ids=[c for c, _ in TRANSCRIPTS])
def test_readme_transcript_is_what_forge_prints(command, expected, forge_cli):
    done = forge_cli(*shlex.split(command)[1:], env={"FORGE_LM_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert done.stdout + done.stderr == expected


TORCHRUN = re.search(
    r"^(torchrun --nproc_per_node=2 -m forge_lm train [^\n]*)$", README.read_text(), flags=re.MULTILINE
)


def test_readme_torchrun_command_trains_on_two_cpu_ranks(tmp_path):
    """The README's multi-process command, as written, shortened by overrides (which come last and win)."""
    assert TORCHRUN, "the README documents a torchrun command"
    args = shlex.split(TORCHRUN.group(1))
    assert args[:2] == ["torchrun", "--nproc_per_node=2"]
    shorter = ["--train.max_steps=2", "--eval.interval=0", "--model.dim=32", f"--train.output_dir={tmp_path / 'run'}"]
    done = torchrun([*args[2:], *shorter], nproc=2, cwd=README.parent)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2 ranks: dp_replicate=1 dp_shard=2" in done.stderr
    assert done.stdout.count("trained 2 steps") == 1


def test_readme_exit_codes_are_the_ones_forge_train_uses():
    """Every exit code the README lists for `forge train` is a constant of the code, and back."""
    from forge_lm.cli._main import INTERRUPTED_EXIT_CODE
    from forge_lm.errors import USAGE_EXIT_CODE
    from forge_lm.plugins import PLUGIN_HOOK_EXIT_CODE
    from forge_lm.train.resilience import FORCED_EXIT_CODE, NONFINITE_EXIT_CODE, PREEMPTED_EXIT_CODE
    from forge_lm.train.saving import SAVE_FAILED_EXIT_CODE

    paragraph = re.search(r"Exit codes of `forge train`: (.*?)\n\n", README.read_text(), flags=re.DOTALL).group(1)
    listed = {int(code) for code in re.findall(r"`(\d+)`", paragraph)}
    assert listed == {
        0,
        USAGE_EXIT_CODE,
        NONFINITE_EXIT_CODE,
        PLUGIN_HOOK_EXIT_CODE,
        SAVE_FAILED_EXIT_CODE,
        PREEMPTED_EXIT_CODE,
        FORCED_EXIT_CODE,
        INTERRUPTED_EXIT_CODE,
    }
