"""Messages that were wrong though the case was handled: each case is refused as before, and
now says what the input is."""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest
from _hostile import Case, Outcome, Workspace, case_params
from test_plugins import TRAIN, install, latest, plugin_site, site_of

__all__ = ["plugin_site"]  # the fixture, shared with test_plugins.py

RESUME = ("train", "{tiny}", "--train.max_steps=6", "--train.output_dir={run}")


def a_fifo(ws: Workspace) -> None:
    os.mkfifo(ws.root / "data.bin")


def assert_only(ws: Workspace, name: str) -> None:
    assert sorted(path.name for path in ws.root.iterdir()) == [name]


def nothing_written(ws: Workspace, outcome: Outcome) -> None:
    assert_only(ws, "data.bin")


def an_empty_corpus(ws: Workspace) -> None:
    (ws.root / "corpus.txt").write_text("")


CASES = [
    Case(
        "empty-corpus-is-not-an-empty-eval-split",
        (
            "train",
            "{tiny}",
            "--data.name=hf_text",
            "--data.format=text",
            "--data.path={root}/corpus.txt",
            "--eval.interval=2",
            "--train.output_dir={run}",
        ),
        2,
        r"forge: error: dataset 'hf_text' \('.*/corpus\.txt'\) holds no text: its 1 rows are all blank",
        setup=an_empty_corpus,
        check=lambda ws, outcome: assert_only(ws, "corpus.txt"),
    ),
    Case(
        "dataset-path-is-a-fifo",
        ("train", "{tiny}", "--data.name=memmap", "--data.path={root}/data.bin", "--train.output_dir={run}"),
        2,
        r"forge: error: dataset 'memmap': path '.*/data\.bin' is a FIFO \(named pipe\), not a file or a directory "
        r"of \.bin, \.npy files\.$",
        setup=a_fifo,
        check=nothing_written,
    ),
    Case(
        "prepare-data-input-is-a-fifo",
        ("prepare-data", "{root}/data.bin", "--output", "{root}/out"),
        2,
        r"forge: error: input '.*/data\.bin' is a FIFO \(named pipe\), not a file or a directory of text files\.$",
        setup=a_fifo,
        check=nothing_written,
    ),
]


@pytest.mark.parametrize("case", case_params(CASES))
def test_case(case, run_case):
    run_case(case)


# -- a plugin's saved state that no plugin restores: loaded (without load_state) or not -----------


def saved_state_of(plugin: str):
    """The newest checkpoint holds a state saved by plugin ``plugin``."""

    def setup(ws: Workspace) -> None:
        path = ws.checkpoints / "step_4" / "trainer_state.json"
        state = json.loads(path.read_text())
        state["trainer"]["plugins"][plugin] = {"seen": 4}
        path.write_text(json.dumps(state))

    return setup


def with_plugin_saving_only(ws: Workspace) -> None:
    """``forge-hostile`` 1.0 saves a state but (this version of it) has no forge_lm_load_state."""
    saved_state_of("hostile")(ws)
    install(ws, "@hookimpl\ndef forge_lm_save_state(context):\n    return {'seen': context.step}\n")


def warns(line: str):
    def check(ws: Workspace, outcome: Outcome) -> None:
        assert f"forge: warning: checkpoint state of plugin {line}" in outcome.stderr, outcome.stderr
        assert "resumed from" in outcome.stderr
        assert latest(ws) == "step_6"

    return check


# -- Ctrl-C while a checkpoint is written ------------------------------------------------------------

# Sends the process a SIGINT (as Ctrl-C does) while DCP writes step 4's files.
CTRL_C_IN_SAVE = """
import os, signal
from torch.distributed.checkpoint.filesystem import FileSystemWriter

write_data = FileSystemWriter.write_data


def interrupted_write(self, plan, planner):
    if str(self.path).endswith("step_4"):
        os.kill(os.getpid(), signal.SIGINT)
    return write_data(self, plan, planner)


FileSystemWriter.write_data = interrupted_write
"""


def ctrl_c_in_the_second_save(ws: Workspace) -> None:
    install(ws, CTRL_C_IN_SAVE)
    ws.env["PYTHONPATH"] = os.pathsep.join([str(site_of(ws)), os.environ.get("PYTHONPATH", "")])


def cut_save_removed(ws: Workspace, outcome: Outcome) -> None:
    assert latest(ws) == "step_2"
    assert sorted(p.name for p in ws.checkpoints.glob("step_*")) == ["step_2"]
    assert "disk" not in outcome.stderr, outcome.stderr
    assert "damaged" not in outcome.stderr, outcome.stderr


# -- a save in progress, seen by another command while the run trains --------------------------------


def a_save_in_progress(step: int, *, only: bool = False):
    """``step_<step>`` holds some of a save's files and no trainer state yet, and the run's lock
    names a live process on this host (this test's parent) training in it. ``only``: the
    run's other checkpoints are gone (the save in progress is its first)."""

    def setup(ws: Workspace) -> None:
        if only:
            for old in ws.checkpoints.glob("step_*"):
                shutil.rmtree(old)
            (ws.checkpoints / "latest").unlink()
        else:
            shutil.copytree(ws.checkpoints / "step_4", ws.checkpoints / f"step_{step}")
        writing = ws.checkpoints / f"step_{step}"
        writing.mkdir(exist_ok=True)
        (writing / "trainer_state.json").unlink(missing_ok=True)
        (writing / "__0_0.distcp").write_bytes(b"half a shard")
        holder = {
            "host": socket.gethostname(),
            "pid": os.getppid(),
            "pid_namespace": os.stat("/proc/self/ns/pid").st_ino,
            "started": "2031-05-04T03:02:01",
            "command": "forge train",
        }
        (ws.run / ".lock").write_text(json.dumps(holder))

    return setup


def left_alone(step: int):
    def check(ws: Workspace, outcome: Outcome) -> None:
        assert (ws.checkpoints / f"step_{step}" / "__0_0.distcp").read_bytes() == b"half a shard"
        assert not list(ws.checkpoints.glob("*.incomplete")), "the save in progress was moved aside"
        assert "interrupted" not in outcome.stderr, outcome.stderr

    return check


def doctor_says_in_progress(ws: Workspace, outcome: Outcome) -> None:
    line = next(c for c in json.loads(outcome.stdout)["checks"] if c["check"] == "checkpoints")
    assert line["status"] == "ok", line
    assert line["detail"].startswith("none yet: step_2 is a save in progress, by the run training in"), line


IN_PROGRESS = rf"a save in progress, by the run training in this directory \(pid {os.getppid()} on host "
GENERATE = ("generate", "{run}", "--prompt", "ab", "--max-new-tokens", "2")

PLUGIN_CASES = [
    Case(
        "generate-while-a-save-is-in-progress",
        GENERATE,
        0,
        rf"forge: warning: passed over checkpoint step_6: {IN_PROGRESS}",
        a_save_in_progress(6),
        needs_run=True,
        check=left_alone(6),
    ),
    Case(
        "generate-while-the-first-save-is-in-progress",
        GENERATE,
        2,
        rf"forge: error: no checkpoint in .*/checkpoints yet: step_2 is {IN_PROGRESS}.*\)\. Try again once that save "
        r"has ended\.$",
        a_save_in_progress(2, only=True),
        needs_run=True,
        check=left_alone(2),
    ),
    Case(
        "doctor-while-the-first-save-is-in-progress",
        ("doctor", "--run-dir", "{run}", "--min-free-gib", "0", "--json"),
        0,
        r"$",
        a_save_in_progress(2, only=True),
        needs_run=True,
        check=lambda ws, outcome: (left_alone(2)(ws, outcome), doctor_says_in_progress(ws, outcome)),
    ),
    Case(
        "plugin-without-load-state-is-loaded",
        RESUME,
        0,
        r"",
        with_plugin_saving_only,
        needs_run=True,
        check=warns(
            r"'hostile' was not restored: plugin 'hostile' (forge-hostile 1.0) is loaded but has no "
            r"forge_lm_load_state hook: it goes on without the state it saved"
        ),
    ),
    Case(
        "plugin-state-of-an-uninstalled-plugin",
        RESUME,
        0,
        r"",
        saved_state_of("gone"),
        needs_run=True,
        check=warns("'gone' was not restored: no plugin of that name is installed"),
    ),
    Case(
        "ctrl-c-while-a-checkpoint-is-written",
        TRAIN,
        130,
        r"forge: interrupted while writing checkpoint step_4, which was removed; the previous checkpoint \(step_2\) "
        r"is intact$",
        ctrl_c_in_the_second_save,
        subprocess=True,
        check=cut_save_removed,
    ),
]


@pytest.mark.parametrize("case", case_params(PLUGIN_CASES))
def test_plugin_case(case, run_case, plugin_site):
    run_case(case)
