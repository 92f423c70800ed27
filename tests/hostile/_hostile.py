"""The hostile-input suite: one table of cases per area, one harness that checks them all.

Each case is a broken or hostile input (a config, a command line, a data file, a checkpoint,
a run directory, a signal, a full disk, a plugin) and the exact outcome Forge owes it: the
exit code, the first ``forge:`` line of the message, no traceback, no sentinel file created
(a payload that ran code would create it), and the newest intact checkpoint of the run it
was given still present, byte for byte.

To grow the suite, add a :class:`Case` to the table of its area (``test_<area>.py``); the
fixtures live in this folder's ``conftest.py``. A case
runs in-process through ``forge_lm.cli.main`` (fast: no interpreter start-up) unless it sets
``subprocess=True`` (needed for signals and for anything that must not touch this process).
"""

from __future__ import annotations

import hashlib
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from forge_lm.cli._main import main
from forge_lm.testing import TINY_MODEL

# A tiny run: 2 layers of width 32, synthetic data, a checkpoint every 2 steps, ~1 s to train.
TINY = (
    *TINY_MODEL,
    "--train.batch_size=2",
    "--train.seq_len=16",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--data.name=synthetic",
    "--checkpoint.interval=2",
)
TRAINED_STEPS = 4  # the shared run holds checkpoints step_2 and step_4 (latest)
PLANNED_STEPS = 6  # ... of a run planned for 6 steps: resuming it with --train.max_steps=6 changes nothing


@dataclass
class Workspace:
    """What a case's ``setup`` may prepare: a scratch folder and, if asked for, a copy of the
    shared trained run (``run``). ``sentinel`` is the file a payload that ran code would create."""

    root: Path
    run: Path
    sentinel: Path
    env: dict[str, str] = field(default_factory=dict)
    damaged: set[str] = field(default_factory=set)  # checkpoints the setup broke on purpose

    def damage(self, step_dir: str) -> Path:
        """Note that the setup breaks checkpoint ``step_dir``; returns its path."""
        self.damaged.add(step_dir)
        return self.checkpoints / step_dir

    @property
    def checkpoints(self) -> Path:
        return self.run / "checkpoints"


@dataclass(frozen=True)
class Case:
    """One hostile or broken input and what Forge must do with it.

    ``argv`` is the ``forge`` command line; ``{run}``, ``{root}`` and ``{sentinel}`` in it are
    replaced by the workspace's paths, and ``{tiny}`` expands to the tiny run's overrides.
    ``first_line`` is a regular expression matched at the start of the first stderr line that
    begins with ``forge:``. ``check`` runs last, with the workspace and the completed command.
    """

    id: str
    argv: tuple[str, ...]
    exit_code: int
    first_line: str
    setup: Callable[[Workspace], None] | None = None
    needs_run: bool = False
    subprocess: bool = False
    check: Callable[[Workspace, Outcome], None] | None = None
    file_size_limit: int | None = None  # bytes any one file may grow to (RLIMIT_FSIZE): a disk that fills up


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def first_forge_line(self) -> str:
        return next((line for line in self.stderr.splitlines() if line.startswith("forge:")), "")


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny run with two checkpoints, trained once and copied into each case that needs it."""
    run = tmp_path_factory.mktemp("hostile-shared") / "run"
    code = main(["train", *TINY, f"--train.max_steps={TRAINED_STEPS}", f"--train.output_dir={run}"])
    assert code == 0
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{TRAINED_STEPS}"
    return run


def copy_run(source: Path, target: Path) -> None:
    """A copy of the shared run, as a run of ``PLANNED_STEPS`` steps interrupted after
    ``TRAINED_STEPS`` would look: its config names its new place and the planned steps, so that
    resuming it with ``--train.max_steps=6`` changes no setting (and prints no note about it)."""
    shutil.copytree(source, target, symlinks=True)
    config = target / "config.toml"
    text = config.read_text().replace(str(source), str(target))
    config.write_text(text.replace(f"max_steps = {TRAINED_STEPS}\n", f"max_steps = {PLANNED_STEPS}\n"))


def fingerprint(checkpoint: Path) -> dict[str, str]:
    return {
        str(p.relative_to(checkpoint)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(checkpoint.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def newest_intact(checkpoints: Path, damaged: set[str]) -> Path | None:
    """The newest checkpoint the case's setup left alone (checked before the case runs)."""
    steps = [
        p
        for p in checkpoints.glob("step_*")
        if p.name not in damaged
        and p.is_dir()
        and not p.is_symlink()
        and p.name[5:].isdigit()
        and (p / "trainer_state.json").is_file()
    ]
    steps = [p for p in steps if (p / ".metadata").is_file()]
    return max(steps, key=lambda p: int(p.name[5:]), default=None)


def _expand(argv: tuple[str, ...], ws: Workspace) -> list[str]:
    out: list[str] = []
    for arg in argv:
        if arg == "{tiny}":
            out.extend(TINY)
            continue
        out.append(arg.format(run=ws.run, root=ws.root, sentinel=ws.sentinel))
    return out


def _run_in_process(args: list[str], ws: Workspace, capsys: pytest.CaptureFixture[str]) -> Outcome:
    capsys.readouterr()
    cwd = os.getcwd()
    saved_env = dict(os.environ)
    os.environ.update(ws.env)
    os.chdir(ws.root)  # a payload writing a relative path writes it here
    try:
        code = main(args)
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    captured = capsys.readouterr()
    return Outcome(code, captured.out, captured.err)


def _limit_file_size(limit: int) -> Callable[[], None]:
    """Run in the child before exec: writes past ``limit`` bytes fail with EFBIG (an OSError, as
    on a full disk) instead of killing the process with SIGXFSZ."""

    def limit_in_child() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return limit_in_child


def _run_subprocess(args: list[str], ws: Workspace, file_size_limit: int | None = None) -> Outcome:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_LM_")}
    env.update(ws.env)
    done = subprocess.run(
        [sys.executable, "-m", "forge_lm", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ws.root,
        timeout=300,
        preexec_fn=_limit_file_size(file_size_limit) if file_size_limit else None,
    )
    return Outcome(done.returncode, done.stdout, done.stderr)


@pytest.fixture
def run_case(
    tmp_path: Path, trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> Callable[[Case], tuple[Workspace, Outcome]]:
    def run(case: Case) -> tuple[Workspace, Outcome]:
        ws = Workspace(root=tmp_path, run=tmp_path / "run", sentinel=tmp_path / "SENTINEL")
        if case.needs_run:
            copy_run(trained_run, ws.run)
        if case.setup is not None:
            case.setup(ws)
        intact = newest_intact(ws.checkpoints, ws.damaged) if ws.checkpoints.is_dir() else None
        before = fingerprint(intact) if intact is not None else None
        args = _expand(case.argv, ws)
        if case.file_size_limit is not None:
            assert case.subprocess, f"{case.id}: a file size limit applies to a subprocess only"
        outcome = (
            _run_subprocess(args, ws, case.file_size_limit) if case.subprocess else _run_in_process(args, ws, capsys)
        )
        detail = f"forge {' '.join(args)}\n--- stderr ---\n{outcome.stderr}"
        assert "Traceback" not in outcome.stderr, detail
        assert outcome.exit_code == case.exit_code, detail
        assert re.match(case.first_line, outcome.first_forge_line), detail
        assert not ws.sentinel.exists(), f"a payload ran code: {ws.sentinel} was created\n{detail}"
        if intact is not None:
            assert intact.is_dir(), f"the newest intact checkpoint {intact.name} was lost\n{detail}"
            assert fingerprint(intact) == before, f"the newest intact checkpoint {intact.name} changed\n{detail}"
        if case.check is not None:
            case.check(ws, outcome)
        return ws, outcome

    return run


def case_params(cases: list[Case]) -> list:
    """``pytest.mark.parametrize`` values for a table, each shown by its id."""
    ids = [case.id for case in cases]
    duplicates = {i for i in ids if ids.count(i) > 1}
    assert not duplicates, f"duplicate case ids: {duplicates}"
    return [pytest.param(case, id=case.id) for case in cases]
