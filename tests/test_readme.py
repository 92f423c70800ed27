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
    from forge_lm.distributed.health import HEALTH_EXIT_CODE
    from forge_lm.errors import USAGE_EXIT_CODE
    from forge_lm.plugins import PLUGIN_HOOK_EXIT_CODE
    from forge_lm.train.resilience import FORCED_EXIT_CODE, NONFINITE_EXIT_CODE, PREEMPTED_EXIT_CODE
    from forge_lm.train.saving import SAVE_FAILED_EXIT_CODE
    from forge_lm.train.watchdog import HANG_EXIT_CODE

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
        HANG_EXIT_CODE,
        HEALTH_EXIT_CODE,
        INTERRUPTED_EXIT_CODE,
    }


USING_FORGE = re.search(r"^## Using Forge\n.*?```bash\n(.*?)```", README.read_text(), flags=re.DOTALL | re.MULTILINE)
USING_COMMANDS = [shlex.split(line, comments=True) for line in USING_FORGE.group(1).splitlines()]
# Training commands as written, made short by overrides (which come last and win).
SHORTER_TRAINING = [
    "--train.max_steps=3",
    "--eval.interval=0",
    "--model.dim=32",
    "--model.n_layers=1",
    "--train.batch_size=2",
    "--train.seq_len=32",
]


def test_readme_commands_start_by_activating_the_environment_make_creates():
    assert USING_COMMANDS[0] == [".", ".venv/bin/activate"]
    assert re.search(r"^VENV := \.venv$", (README.parent / "Makefile").read_text(), flags=re.MULTILINE)
    assert all(command[0] == "forge" for command in USING_COMMANDS[1:])


def test_readme_run_directories_are_the_ones_forge_and_make_demo_write():
    from forge_lm.config import TrainSection

    text = README.read_text()
    assert USING_COMMANDS[1] == ["forge", "train"]  # the first command trains the run the next ones use
    assert f"into {TrainSection().output_dir}" in USING_FORGE.group(1)
    makefile = (README.parent / "Makefile").read_text()
    assert "run=runs/demo-$$(date +%Y%m%d-%H%M%S)" in makefile
    assert "--train.output_dir=$$run" in makefile
    assert "`runs/demo-<date>-<time>`" in text


@pytest.fixture(scope="module")
def using_forge(tmp_path_factory):
    """Every command of "Using Forge", in order, in-process in a fresh directory holding the
    checkout's configs/ and docs/ (training made short); returns the directory and, per command,
    (exit code, stdout, stderr)."""
    import contextlib
    import glob
    import io
    import os

    from forge_lm.cli._main import main

    work = tmp_path_factory.mktemp("checkout")
    for name in ("configs", "docs"):
        (work / name).symlink_to(README.parent / name, target_is_directory=True)
    previous = os.getcwd()
    os.chdir(work)
    results = []
    try:
        for command in USING_COMMANDS[1:]:
            args = [found for arg in command[1:] for found in (sorted(glob.glob(arg)) if "*" in arg else [arg])]
            if args[0] == "train":
                args += SHORTER_TRAINING
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(args)
                except SystemExit as exit_:  # argparse's way out
                    code = exit_.code
            results.append((code, out.getvalue(), err.getvalue()))
    finally:
        os.chdir(previous)
    return work, results


@pytest.mark.parametrize("index", range(len(USING_COMMANDS) - 1), ids=[" ".join(c) for c in USING_COMMANDS[1:]])
def test_readme_commands_succeed_in_the_order_written(using_forge, index):
    code, out, err = using_forge[1][index]
    assert code == 0, out[-2000:] + err[-2000:]
    assert "Traceback" not in err


def test_gitignore_covers_what_the_readme_commands_create(using_forge):
    work, _ = using_forge
    patterns = [line.strip().rstrip("/") for line in (README.parent / ".gitignore").read_text().splitlines()]
    created = sorted(path.name for path in work.iterdir() if path.name not in ("configs", "docs"))
    assert {"runs", "hf-model", "shards"} <= set(created)
    assert [name for name in created if name not in patterns] == []


def test_readme_demo_loss_starts_where_the_readme_says_and_step_1_is_logged(tmp_path, capsys):
    """The default run (that of `make demo`), with its default log interval, logs step 1 at the
    loss the README gives."""
    from forge_lm.cli._main import main
    from forge_lm.metrics.jsonl import read_metrics

    start = float(re.search(r"the loss falls from about (\d+\.\d+) at step 1", README.read_text()).group(1))

    assert main(["train", "--train.max_steps=2", "--eval.interval=0", f"--train.output_dir={tmp_path / 'run'}"]) == 0

    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["loss"] == pytest.approx(start, abs=0.1)
    assert capsys.readouterr().out.count("\nstep 1/") == 1
