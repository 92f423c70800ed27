"""A disk that fills up while a run writes: checkpoints and metrics that cannot be written.

Each case runs ``forge train`` in a child process whose files may not grow past a size
(``RLIMIT_FSIZE``, with SIGXFSZ ignored, so a write past it fails with an OSError as on a full
disk). The shared run's checkpoint shards are about 650 kB, its trainer state about 60 kB.
"""

from __future__ import annotations

import re

import pytest
from _hostile import Case, Outcome, Workspace, case_params

from forge_lm.metrics.jsonl import read_metrics

RESUME = ("train", "{tiny}", "--train.output_dir={run}")
FULL_AT_SHARDS = 200_000  # room for everything but a checkpoint's shard


def planned(**settings: int):
    """The copied run's config.toml plans these [train] / [checkpoint] settings, so that resuming
    with the same values on the command line changes nothing (and prints no note about it)."""

    def setup(ws: Workspace) -> None:
        config = ws.run / "config.toml"
        text = config.read_text()
        for key, value in settings.items():
            section = re.search(rf"^\[{_SECTIONS[key]}\]$.*?(?=^\[|\Z)", text, flags=re.MULTILINE | re.DOTALL)
            body = re.sub(rf"^{key} = .*$", f"{key} = {value}", section.group(0), count=1, flags=re.MULTILINE)
            text = text[: section.start()] + body + text[section.end() :]
        config.write_text(text)

    return setup


_SECTIONS = {"max_steps": "train", "interval": "checkpoint", "max_failed_saves": "checkpoint"}


def resumed_planning(**settings: int) -> dict:
    """A resume whose command line and copied config.toml both plan ``settings``: the command
    line's ``argv`` and the ``setup`` that writes them into the config."""
    argv = (*RESUME, *(f"--{_SECTIONS[key]}.{key}={value}" for key, value in settings.items()))
    return {"argv": argv, "setup": planned(**settings)}


def logged_steps(*expected: int):
    def check(ws: Workspace, outcome: Outcome) -> None:
        steps = [r["step"] for r in read_metrics(ws.run / "metrics.jsonl") if "loss" in r]
        assert steps == list(expected), steps
        assert not any((ws.checkpoints / f"step_{s}").exists() for s in expected if s > 4), "a partial save was kept"
        assert (ws.checkpoints / "latest").read_text().strip() == "step_4"

    return check


def metrics_backend_turned_off(ws: Workspace, outcome: Outcome) -> None:
    assert re.search(
        r"forge: warning: metrics backend 'jsonl' \(forge-lm [^)]*\) failed in log \(step \d+\): "
        r"OSError: \[Errno 27\] File too large; it is off for the rest of this run",
        outcome.stderr,
    ), outcome.stderr
    assert outcome.stderr.count("cannot write the event log") == 1  # warned once, then left alone


CASES = [
    Case(
        id="checkpoint-saves-fail-until-the-limit",
        **resumed_planning(max_steps=10, max_failed_saves=2),
        exit_code=5,
        first_line=r"forge: warning: could not write checkpoint '.*step_6': .*The previous checkpoint \(step_4\) "
        r"is intact",
        needs_run=True,
        subprocess=True,
        file_size_limit=FULL_AT_SHARDS,
        check=logged_steps(1, 2, 3, 4, 5, 6, 7, 8),
    ),
    Case(
        id="final-checkpoint-save-fails",
        **resumed_planning(max_steps=5, interval=0),
        exit_code=5,
        first_line=r"forge: error: could not write checkpoint '.*step_5': .*Stopping: this was the final save",
        needs_run=True,
        subprocess=True,
        file_size_limit=FULL_AT_SHARDS,
        check=logged_steps(1, 2, 3, 4, 5),
    ),
    Case(
        id="metrics-file-full-turns-the-backend-off",
        **resumed_planning(max_steps=12, interval=0, max_failed_saves=1),
        exit_code=5,
        # The event log, appended to first (at the start), is the first file to hit the limit.
        first_line=r"forge: warning: cannot write the event log .*events\.jsonl \(\[Errno 27\] File too large\); "
        "events are not recorded",
        check=metrics_backend_turned_off,
        needs_run=True,
        subprocess=True,
        file_size_limit=1_500,  # metrics.jsonl reaches it within a few steps; the final save cannot fit either
    ),
]


@pytest.mark.parametrize("case", case_params(CASES))
def test_case(case, run_case):
    run_case(case)
