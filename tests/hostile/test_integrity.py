"""What a run must never lose or overwrite: checkpoints of broken weights that would replace good
ones, runs that write where they must not (a user's folder, the current directory, the file
system's root, another run's checkpoints, a run directory removed under them), and a first
save cut short that would block the run forever.

Plugins are installed as in ``test_plugins``: one module, ``forge_hostile``, in a fake site on
``sys.path``.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from _hostile import TINY, Case, Outcome, Workspace, case_params

from forge_lm.cli._main import main

RESUME = ("train", "{tiny}", "--train.max_steps=6", "--train.output_dir={run}")
KEEP_ONE = ("--checkpoint.interval=1", "--checkpoint.keep_last_n=1")
NONFINITE = r"forge: error: not writing checkpoint step_3: the weights are not finite: '.*' holds NaN or Inf"

# An optimizer that trains like SGD and, at its third step, fills the weights with NaN (the
# step's loss, computed before the update, is still finite).
NAN_AT_STEP_3 = """
import torch

class NanAtStep3(torch.optim.SGD):
    def step(self, closure=None):
        super().step(closure)
        if self.param_groups[0]["lr"] == 0:  # torch's state-dict helpers step once with lr 0
            return
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 3:
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p.fill_(float("nan"))

@hookimpl
def forge_lm_register_optimizers(register):
    register("nan_at_3", lambda options, model: NanAtStep3(model.parameters(), lr=0.01), description="NaN at 3")
"""


def install(ws: Workspace, body: str) -> None:
    """Install ``forge-hostile`` 1.0 (entry point ``hostile``) whose module holds ``body``."""
    site = ws.root / "site"
    (site / "forge_hostile.py").write_text('from forge_lm import hookimpl\nFORGE_LM_PLUGIN_API = ">=1,<2"\n')
    with (site / "forge_hostile.py").open("a") as module:
        module.write(textwrap.dedent(body))
    info = site / "forge_hostile-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: forge-hostile\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[forge_lm]\nhostile = forge_hostile\n")
    importlib.invalidate_caches()


@pytest.fixture
def plugin_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(site)):
            del sys.modules[name]
    importlib.invalidate_caches()


def _events(ws: Workspace) -> list[dict]:
    return [json.loads(line) for line in (ws.run / "events.jsonl").read_text().splitlines()]


def _steps(ws: Workspace) -> list[str]:
    return sorted(p.name for p in ws.checkpoints.glob("step_*"))


# -- checkpoints of broken weights ------------------------------------------------------------------


def _nan_optimizer(ws: Workspace) -> None:
    install(ws, NAN_AT_STEP_3)


def _stopped_keeping_step_2(ws: Workspace, outcome: Outcome) -> None:
    assert _steps(ws) == ["step_2"]
    assert (ws.checkpoints / "latest").read_text().strip() == "step_2"
    failed = [e for e in _events(ws) if e["type"] == "checkpoint_failed"]
    assert [(e["checkpoint"], e["action"]) for e in failed] == [("step_3", "stop")]
    assert "not finite" in failed[0]["reason"]
    assert not any(e["type"] == "checkpoint_saved" and e["checkpoint"] == "step_3" for e in _events(ws))


def _rolled_back_to_step_2(ws: Workspace, outcome: Outcome) -> None:
    """Rolled back to step_2 at the refused save of step 3, then on to step 4 and 5 (the
    optimizer is built again by nothing: its own step count goes on, past 3)."""
    assert "rolled back to step 2 (the newest checkpoint)" in outcome.stderr
    failed = [e for e in _events(ws) if e["type"] == "checkpoint_failed"]
    assert [(e["checkpoint"], e["action"]) for e in failed] == [("step_3", "rollback")]
    assert _steps(ws) == ["step_5"]  # keep_last_n = 1: only finite checkpoints counted and kept
    resumed = json.loads((ws.checkpoints / "step_5" / "trainer_state.json").read_text())
    assert resumed["step"] == 5


def _resumes_from_step_2(ws: Workspace, outcome: Outcome) -> None:
    """The next start resumes from the finite step_2 (its optimizer, built anew, counts its
    steps from 0 again: steps 3 and 4 stay finite)."""
    argv = ["train", *TINY, *KEEP_ONE, "--optimizer.name=nan_at_3", "--resilience.nan_policy=stop"]
    assert main([*argv, "--train.max_steps=4", f"--train.output_dir={ws.run}"]) == 0
    assert _steps(ws) == ["step_4"]


def _no_checkpoint(ws: Workspace, outcome: Outcome) -> None:
    assert not ws.checkpoints.exists() or not _steps(ws), _steps(ws)
    failed = [e for e in _events(ws) if e["type"] == "checkpoint_failed"]
    assert [(e["checkpoint"], e["action"]) for e in failed] == [("step_1", "stop")]


MAX_3 = ("--train.max_steps=3", "--train.output_dir={run}")
NAN_RUN = ("train", "{tiny}", *KEEP_ONE, "--optimizer.name=nan_at_3", "--train.output_dir={run}")

PLUGIN_CASES = [
    Case(
        "optimizer-fills-the-weights-with-nan-stop",
        (*NAN_RUN, "--train.max_steps=5", "--resilience.nan_policy=stop"),
        3,
        NONFINITE + r" \(the step's loss was finite: its update made them so\); stopping because of "
        r"resilience\.nan_policy = 'stop'",
        setup=_nan_optimizer,
        check=lambda ws, outcome: (_stopped_keeping_step_2(ws, outcome), _resumes_from_step_2(ws, outcome)),
    ),
    Case(
        "optimizer-fills-the-weights-with-nan-skip-cannot-undo",
        (*NAN_RUN, "--train.max_steps=5", "--resilience.nan_policy=skip"),
        3,
        NONFINITE + r".*resilience\.nan_policy = 'skip', which cannot undo an update already applied",
        setup=_nan_optimizer,
        check=_stopped_keeping_step_2,
    ),
    Case(
        "optimizer-fills-the-weights-with-nan-rollback",
        (*NAN_RUN, "--train.max_steps=5", "--resilience.nan_policy=rollback"),
        0,
        r"forge: warning: not writing checkpoint step_3: the weights are not finite",
        setup=_nan_optimizer,
        check=_rolled_back_to_step_2,
    ),
]

BUILTIN_CASES = [
    Case(
        "huge-learning-rate-rollback-with-nothing-to-roll-back-to",
        ("train", "{tiny}", *KEEP_ONE, "--optimizer.lr=1e38", "--resilience.nan_policy=rollback", *MAX_3),
        3,
        r"forge: error: not writing checkpoint step_1: the weights are not finite: .*resilience\.nan_policy = "
        r"'rollback' but there is no checkpoint to roll back to",
        check=_no_checkpoint,
    ),
]


# -- runs that write where they must not ---------------------------------------------------------

USER_CONFIG = b"# my own notes, not a Forge run\n[train]\nmax_steps = 2\n"


def _users_folder(ws: Workspace) -> None:
    ws.run.mkdir()
    (ws.run / "config.toml").write_bytes(USER_CONFIG)


def _users_folder_untouched(ws: Workspace, outcome: Outcome) -> None:
    assert sorted(p.name for p in ws.run.iterdir()) == ["config.toml"]
    assert (ws.run / "config.toml").read_bytes() == USER_CONFIG


def _nothing_in_root(ws: Workspace, outcome: Outcome) -> None:
    """Nothing written in the current directory (the case's root, which holds the plugin site)."""
    assert sorted(p.name for p in ws.root.iterdir()) == ["site"]


OTHER_RUN = "0123456789abcdef0123456789abcdef"


def _another_runs_checkpoint(step: int):
    """Another run wrote ``step_<step>`` into this run's checkpoints folder: a shared folder as
    one run sees it after both saved."""

    def setup(ws: Workspace) -> None:
        other = ws.root / "other"
        shutil.copytree(ws.checkpoints / "step_4", other)
        state = json.loads((other / "trainer_state.json").read_text())
        state["run_id"], state["step"] = OTHER_RUN, step
        (other / "trainer_state.json").write_text(json.dumps(state))
        other.rename(ws.checkpoints / f"step_{step}")
        ws.damaged.add(f"step_{step}")

    return setup


def _still_the_other_runs(step: int):
    def check(ws: Workspace, outcome: Outcome) -> None:
        other = json.loads((ws.checkpoints / f"step_{step}" / "trainer_state.json").read_text())
        assert other["run_id"] == OTHER_RUN  # never replaced, never pruned

    return check


def _refused_to_replace(ws: Workspace, outcome: Outcome) -> None:
    assert re.search(
        r"forge: error: not writing checkpoint step_6: '.*/run/checkpoints/step_6' is another run's checkpoint "
        r"\(run id " + OTHER_RUN + r", this run's is [0-9a-f]{32}\): two runs share '.*'\. Give each run its own "
        r"train\.output_dir\. Nothing was written there\. Stopping: no retry can help\.$",
        outcome.stderr,
        re.MULTILINE,
    ), outcome.stderr


def _resumed_its_own(ws: Workspace, outcome: Outcome) -> None:
    assert f"resumed from {ws.checkpoints / 'step_4'} (step 4)" in outcome.stderr
    _still_the_other_runs(8)(ws, outcome)
    own = json.loads((ws.checkpoints / "step_6" / "trainer_state.json").read_text())
    assert own["run_id"] == (ws.run / "run_id").read_text().strip()


REMOVES_THE_RUN = """
import shutil

@hookimpl
def forge_lm_step_end(context, step):
    if step == 3:
        shutil.rmtree(context.run_dir)
"""


def _nothing_recreated(ws: Workspace, outcome: Outcome) -> None:
    assert re.search(
        r"^forge: error: not writing checkpoint step_4: the run directory '.*/run' was removed or replaced while "
        r"the run trained \(its run_id is gone\); a checkpoint written there would belong to no run\. Nothing "
        r"was written there\. Stopping: no retry can help\.$",
        outcome.stderr,
        re.MULTILINE,
    ), outcome.stderr
    assert not ws.run.exists(), sorted(str(p) for p in ws.run.rglob("*"))
    assert "trained" not in outcome.stdout


def _seed_edited(ws: Workspace) -> None:
    config = ws.run / "config.toml"
    assert "seed = 0\n" in config.read_text()
    config.write_text(config.read_text().replace("seed = 0\n", "seed = 7\n"))


def _cut_first_save(ws: Workspace) -> None:
    """A run killed (SIGKILL) while its first checkpoint was written: step_2 holds some tensor
    files but no trainer_state.json."""
    shutil.rmtree(ws.checkpoints / "step_4")
    (ws.checkpoints / "latest").unlink()
    (ws.checkpoints / "step_2" / "trainer_state.json").unlink()
    ws.damaged.add("step_2")


def _started_afresh(ws: Workspace, outcome: Outcome) -> None:
    assert "has no checkpoint yet; starting from step 0" in outcome.stderr
    assert (ws.checkpoints / "step_2.incomplete" / ".metadata").is_file()  # moved aside, not deleted
    assert _steps(ws) == ["step_2", "step_2.incomplete", "step_4", "step_6"]
    assert (ws.checkpoints / "latest").read_text().strip() == "step_6"


CASES = [
    *PLUGIN_CASES,
    *BUILTIN_CASES,
    Case(
        "output-dir-holds-the-users-own-config",
        ("train", "{tiny}", "--train.max_steps=2", "--train.output_dir={run}"),
        2,
        r"forge: error: \[train\] output_dir: '.*/run' is not empty \('config\.toml'\) and holds no Forge run",
        setup=_users_folder,
        check=_users_folder_untouched,
    ),
    Case(
        "output-dir-empty-an-unset-shell-variable",
        ("train", "{tiny}", "--train.max_steps=2", "--train.output_dir="),
        2,
        r"forge: error: \[train\] output_dir: is empty; name the run directory",
        check=_nothing_in_root,
    ),
    Case(
        "output-dir-is-the-file-system-root",
        ("train", "{tiny}", "--train.max_steps=2", "--train.output_dir=/"),
        2,
        r"forge: error: \[train\] output_dir: is the file system's root \('/'\)",
        check=_nothing_in_root,
    ),
    Case(
        "another-runs-checkpoint-in-the-checkpoints-folder",
        RESUME,
        0,
        r"forge: warning: passed over checkpoint step_8: written by another run \(run id " + OTHER_RUN,
        setup=_another_runs_checkpoint(8),
        needs_run=True,
        check=_resumed_its_own,
    ),
    Case(
        "another-runs-checkpoint-where-this-run-saves",
        RESUME,
        5,
        r"forge: warning: passed over checkpoint step_6: written by another run",
        setup=_another_runs_checkpoint(6),
        needs_run=True,
        check=lambda ws, outcome: (_still_the_other_runs(6)(ws, outcome), _refused_to_replace(ws, outcome)),
    ),
    Case(
        "only-another-runs-checkpoints",
        RESUME,
        2,
        r"forge: error: no usable checkpoint in .*/run/checkpoints:",
        setup=lambda ws: (
            _another_runs_checkpoint(8)(ws),
            shutil.rmtree(ws.checkpoints / "step_2"),
            shutil.rmtree(ws.checkpoints / "step_4"),
        ),
        needs_run=True,
        check=_still_the_other_runs(8),
    ),
    Case(
        "run-directory-removed-while-training",
        ("train", "{tiny}", "--train.max_steps=4", "--train.output_dir={run}"),
        5,
        r"forge: warning: cannot write the event log .*/run/events\.jsonl",  # the directory is gone
        setup=lambda ws: install(ws, REMOVES_THE_RUN),
        check=_nothing_recreated,
    ),
    Case(
        "seed-edited-in-the-runs-config-toml",
        ("train", "{run}/config.toml"),
        2,
        r"forge: error: \[train\] output_dir: checkpoint step_4 of '.*/run' was written with other settings for "
        r"train\.seed \(train\.seed = 0 there, 7 here\)",
        setup=_seed_edited,
        needs_run=True,
    ),
    # -- a cut first save -------------------------------------------------------------------------
    Case(
        "first-save-cut-short-by-sigkill",
        RESUME,
        0,
        r"forge: warning: step_2 is not a checkpoint: its save was cut short \(trainer_state\.json is missing\); "
        r"moved it aside to '.*/checkpoints/step_2\.incomplete'",
        setup=_cut_first_save,
        needs_run=True,
        check=_started_afresh,
    ),
]


@pytest.mark.parametrize("case", case_params(CASES))
def test_case(case, run_case, plugin_site):
    run_case(case)
