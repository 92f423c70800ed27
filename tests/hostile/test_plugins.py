"""Hostile and broken plugins: hooks that raise, exit or return garbage, metrics backends that
fail, plugins that do not load. Each case installs one plugin, ``hostile`` from the
distribution ``forge-hostile`` 1.0, into a fake site on ``sys.path`` and runs ``forge train``
in-process. The policy under test is documented in ``forge_lm.hookspecs``: a failing
training hook stops with exit 4 after checkpointing the last completed step; train_end and
metrics backends fail with a warning; garbage metrics are left out with a warning.
"""

from __future__ import annotations

import importlib
import math
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from _hostile import TINY, Case, Outcome, Workspace, case_params

from forge_lm.cli._main import main
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PLUGIN_API_VERSION

PLUGIN = r"plugin 'hostile' \(forge-hostile 1\.0\)"
TRAIN = ("train", "{tiny}", "--train.max_steps=4", "--train.output_dir={run}")
WITH_BACKEND = (*TRAIN, '--metrics.backends=["jsonl", "hostile"]')
HEADER = "from forge_lm import hookimpl\n"


def site_of(ws: Workspace) -> Path:
    return ws.root / "site"


def install(ws: Workspace, body: str, *, api: str | None = '">=1,<2"') -> None:
    """Install ``forge-hostile`` 1.0 (entry point ``hostile``) whose module holds ``body``."""
    site = site_of(ws)
    header = HEADER if api is None else f"{HEADER}FORGE_LM_PLUGIN_API = {api}\n"
    (site / "forge_hostile.py").write_text(header + textwrap.dedent(body))
    info = site / "forge_hostile-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: forge-hostile\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[forge_lm]\nhostile = forge_hostile\n")
    importlib.invalidate_caches()


def plugin(body: str, *, api: str | None = '">=1,<2"') -> Callable[[Workspace], None]:
    return lambda ws: install(ws, body, api=api)


def hook(name: str, args: str, action: str) -> Callable[[Workspace], None]:
    """A plugin whose hook ``name`` does ``action`` (one statement)."""
    return plugin(f"import sys, math\n\n@hookimpl\ndef {name}({args}):\n    {action}\n")


def step_end_returns(value: str) -> Callable[[Workspace], None]:
    return hook("forge_lm_step_end", "step", f"return {value}")


def backend_failing_in(method: str) -> Callable[[Workspace], None]:
    return plugin(
        f"""
        class Backend:
            def start(self, config, manifest):
                pass

            def log(self, step, metrics):
                pass

            def finish(self, summary):
                pass

            def {method}(self, *args):
                raise OSError(28, "No space left on device")


        @hookimpl
        def forge_lm_register_metrics_backends(register):
            register("hostile", lambda options, context: Backend(), description="A backend that fails")
        """
    )


def trained_with_state_then_failing_load(ws: Workspace) -> None:
    """A run of 4 steps whose checkpoints hold the plugin's state; the case's run (with
    HOSTILE_FAIL set) resumes it with the same command, and load_state raises."""
    install(
        ws,
        """
        import os

        @hookimpl
        def forge_lm_save_state(context):
            return {"step": context.step}

        @hookimpl
        def forge_lm_load_state(state):
            if os.environ.get("HOSTILE_FAIL"):
                raise ValueError("state from another version")
        """,
    )
    assert main(["train", *TINY, "--train.max_steps=4", f"--train.output_dir={ws.run}"]) == 0
    ws.env["HOSTILE_FAIL"] = "1"


def blocked_metrics_file(ws: Workspace) -> None:
    """A run directory Forge made (its empty checkpoints/: not a stranger's folder, which a run
    refuses) whose metrics.jsonl is a directory."""
    (ws.run / "metrics.jsonl").mkdir(parents=True)
    (ws.run / "checkpoints").mkdir()


# -- checks run after a case --------------------------------------------------------------------


def latest(ws: Workspace) -> str | None:
    pointer = ws.checkpoints / "latest"
    return pointer.read_text().strip() if pointer.exists() else None


def records(ws: Workspace) -> list[dict]:
    return read_metrics(ws.run / "metrics.jsonl")


def stopped_at(step: int, logged: list[int]) -> Callable[[Workspace, Outcome], None]:
    """The run stopped with a checkpoint of ``step`` and these training steps in metrics.jsonl."""

    def check(ws: Workspace, outcome: Outcome) -> None:
        assert latest(ws) == f"step_{step}"
        assert [r["step"] for r in records(ws) if "loss" in r] == logged

    return check


def completed(ws: Workspace, outcome: Outcome) -> None:
    assert latest(ws) == "step_4"
    assert [r["step"] for r in records(ws) if "loss" in r] == [1, 2, 3, 4]


def completed_without_metrics(ws: Workspace, outcome: Outcome) -> None:
    assert latest(ws) == "step_4"
    assert (ws.run / "metrics.jsonl").is_dir()


def nothing_written(ws: Workspace, outcome: Outcome) -> None:
    assert not ws.run.exists()


def nothing_saved(ws: Workspace, outcome: Outcome) -> None:
    assert latest(ws) is None


def one_warning(ws: Workspace, outcome: Outcome) -> None:
    completed(ws, outcome)
    assert sum(line.startswith("forge: warning:") for line in outcome.stderr.splitlines()) == 1


def nan_metric_logged(ws: Workspace, outcome: Outcome) -> None:
    completed(ws, outcome)
    assert all(math.isnan(r["hostile/x"]) for r in records(ws) if "loss" in r)


STOPPED = "Fix the plugin or run without it \\(--block-plugin hostile\\), then run the same command to resume\\.$"

CASES = [
    # -- a training hook raises: exit 4, the last completed step saved ---------------------------------
    Case(
        "train-start-raises",
        TRAIN,
        4,
        rf"forge: error: {PLUGIN} raised in forge_lm_train_start: ValueError: boom\. Training stopped at step 0; "
        rf"no checkpoint was written yet\. {STOPPED}",
        setup=hook("forge_lm_train_start", "", "raise ValueError('boom')"),
        check=nothing_saved,
    ),
    Case(
        "step-end-raises",
        TRAIN,
        4,
        rf"forge: error: {PLUGIN} raised in forge_lm_step_end: ValueError: boom\. Training stopped at step 3 after "
        rf"saving a checkpoint of that step, which is intact\. {STOPPED}",
        setup=hook("forge_lm_step_end", "step", "if step == 3: raise ValueError('boom')"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "eval-end-raises",
        (*TRAIN, "--eval.interval=3", "--eval.steps=1"),
        4,
        rf"forge: error: {PLUGIN} raised in forge_lm_eval_end: KeyError: 'eval/acc'\. Training stopped at step 3 "
        rf"after saving a checkpoint of that step, which is intact\. {STOPPED}",
        setup=hook("forge_lm_eval_end", "metrics", "return {'x': metrics['eval/acc']}"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "save-state-raises",
        TRAIN,
        4,
        rf"forge: error: {PLUGIN} raised in forge_lm_save_state: OSError: read-only\. Training stopped at step 4; "
        rf"the newest checkpoint \(step_2\) is intact\. {STOPPED}",
        setup=hook("forge_lm_save_state", "context", "if context.step == 4: raise OSError('read-only')"),
        check=stopped_at(2, [1, 2, 3, 4]),
    ),
    Case(
        "save-state-returns-an-object",
        TRAIN,
        4,
        rf"forge: error: {PLUGIN} returned a state from forge_lm_save_state that cannot be saved: 'state\['lock'\]' "
        rf"is a lock; checkpoints keep tensors and plain data only\. Training stopped at step 2; no checkpoint was "
        rf"written yet\. {STOPPED}",
        setup=hook("forge_lm_save_state", "", "import threading; return {'lock': threading.Lock()}"),
        check=nothing_saved,
    ),
    Case(
        "load-state-raises-on-resume",
        TRAIN,
        4,
        rf"forge: error: {PLUGIN} raised in forge_lm_load_state: ValueError: state from another version\. Training "
        rf"stopped at step 4; the newest checkpoint \(step_4\) is intact\. {STOPPED}",
        setup=trained_with_state_then_failing_load,
    ),
    # -- train_end: a warning; the run's outcome stands --------------------------------------------------
    Case(
        "train-end-raises-after-completion",
        TRAIN,
        0,
        rf"forge: warning: {PLUGIN} raised in forge_lm_train_end: ValueError: boom; the run's outcome stands$",
        setup=hook("forge_lm_train_end", "", "raise ValueError('boom')"),
        check=completed,
    ),
    Case(
        "train-end-exits-after-completion",
        TRAIN,
        0,
        rf"forge: warning: {PLUGIN} raised in forge_lm_train_end: SystemExit: 3; the run's outcome stands$",
        setup=hook("forge_lm_train_end", "", "sys.exit(3)"),
        check=completed,
    ),
    Case(
        "train-end-raises-after-a-failed-step",
        TRAIN,
        4,
        rf"forge: warning: {PLUGIN} raised in forge_lm_train_end: RuntimeError: cleanup; the run's outcome stands$",
        setup=plugin(
            """
            @hookimpl
            def forge_lm_step_end(step):
                if step == 1:
                    raise ValueError("boom")

            @hookimpl
            def forge_lm_train_end():
                raise RuntimeError("cleanup")
            """
        ),
        check=lambda ws, outcome: (
            stopped_at(1, [1])(ws, outcome),
            assert_second_forge_line(outcome, rf"forge: error: {PLUGIN} raised in forge_lm_step_end: ValueError"),
        ),
    ),
    # -- a hook ends the process its own way ---------------------------------------------------------
    Case(
        "step-end-calls-sys-exit",
        TRAIN,
        4,
        rf"forge: error: {PLUGIN} raised in forge_lm_step_end: SystemExit: 0\. Training stopped at step 2 after "
        rf"saving a checkpoint of that step, which is intact\.",
        setup=hook("forge_lm_step_end", "step", "if step == 2: sys.exit(0)"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "step-end-raises-a-base-exception",
        TRAIN,
        4,
        rf"forge: error: {PLUGIN} raised in forge_lm_step_end: Odd: not an Exception\. Training stopped at step 3 "
        rf"after saving",
        setup=plugin(
            """
            class Odd(BaseException):
                pass

            @hookimpl
            def forge_lm_step_end(step):
                if step == 3:
                    raise Odd("not an Exception")
            """
        ),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(  # no SIGINT came: the plugin's own KeyboardInterrupt is its failure, not the user's Ctrl-C
        "step-end-raises-keyboard-interrupt",
        TRAIN,
        4,
        rf"forge: error: {PLUGIN} raised in forge_lm_step_end: KeyboardInterrupt\. Training stopped at step 3 after "
        r"saving a checkpoint of that step, which is intact\.",
        setup=hook("forge_lm_step_end", "step", "if step == 3: raise KeyboardInterrupt"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    # -- garbage returned from step_end: left out with one warning, the run goes on ----------------------
    Case(
        "step-end-returns-a-string",
        TRAIN,
        0,
        rf"forge: warning: {PLUGIN} returned unusable metrics from forge_lm_step_end: a str instead of a dict of "
        r"metric names to numbers\. They are left out \(this warning is not repeated\); the run goes on\.$",
        setup=step_end_returns("'loss went down'"),
        check=one_warning,
    ),
    Case(
        "step-end-returns-a-list",
        TRAIN,
        0,
        rf"forge: warning: {PLUGIN} returned unusable metrics from forge_lm_step_end: a list instead of a dict",
        setup=step_end_returns("[1.0, 2.0]"),
        check=one_warning,
    ),
    Case(
        "step-end-returns-non-string-keys",
        TRAIN,
        0,
        rf"forge: warning: {PLUGIN} returned unusable metrics from forge_lm_step_end: key 1 is not a non-empty "
        r"string; key \(2, 3\) is not a non-empty string\.",
        setup=step_end_returns("{1: 1.0, (2, 3): 2.0, 'hostile/ok': 3.0}"),
        check=lambda ws, outcome: (
            one_warning(ws, outcome),
            assert_each_step_has(ws, "hostile/ok", 3.0),
        ),
    ),
    Case(
        "step-end-returns-non-number-values",
        TRAIN,
        0,
        rf"forge: warning: {PLUGIN} returned unusable metrics from forge_lm_step_end: 'a' is a str, not a number; "
        r"'b' is a NoneType, not a number; 'c' is a bool, not a number; 'd' is a dict, not a number\.",
        setup=step_end_returns("{'a': '1.0', 'b': None, 'c': True, 'd': {}}"),
        check=one_warning,
    ),
    Case(
        "step-end-overwrites-the-loss",
        TRAIN,
        0,
        rf"forge: warning: {PLUGIN} returned unusable metrics from forge_lm_step_end: 'loss' would overwrite the "
        r"core's own metric\.",
        setup=step_end_returns("{'loss': 0.0}"),
        check=lambda ws, outcome: (one_warning(ws, outcome), assert_losses_positive(ws)),
    ),
    Case(
        "step-end-returns-nan-instead-of-a-dict",
        TRAIN,
        0,
        rf"forge: warning: {PLUGIN} returned unusable metrics from forge_lm_step_end: a float instead of a dict",
        setup=step_end_returns("float('nan')"),
        check=one_warning,
    ),
    Case(
        "step-end-returns-a-nan-metric",
        TRAIN,
        0,
        r"$",  # NaN is a number: logged as it is, no warning
        setup=step_end_returns("{'hostile/x': math.nan}"),
        check=nan_metric_logged,
    ),
    # -- metrics backends that fail: turned off with one warning, training goes on -------------------------
    Case(
        "backend-raises-in-start",
        WITH_BACKEND,
        0,
        r"forge: warning: metrics backend 'hostile' \(forge-hostile 1\.0\) failed in start: OSError: \[Errno 28\] "
        r"No space left on device; it is off for the rest of this run; training and the other metrics backends go "
        r"on$",
        setup=backend_failing_in("start"),
        check=one_warning,
    ),
    Case(
        "backend-raises-in-log",
        WITH_BACKEND,
        0,
        r"forge: warning: metrics backend 'hostile' \(forge-hostile 1\.0\) failed in log \(step 1\): OSError: ",
        setup=backend_failing_in("log"),
        check=one_warning,
    ),
    Case(
        "backend-raises-in-finish",
        WITH_BACKEND,
        0,
        r"forge: warning: metrics backend 'hostile' \(forge-hostile 1\.0\) failed in finish: OSError: \[Errno 28\] "
        r"No space left on device; what it logged before may be incomplete$",
        setup=backend_failing_in("finish"),
        check=one_warning,
    ),
    Case(
        "backend-factory-raises",
        WITH_BACKEND,
        2,
        rf"forge: error: metrics backend 'hostile' from {PLUGIN} could not be built: ConnectionError: tracker "
        r"unreachable\. Check its options; if they are right, this is a bug in forge-hostile: report it to its "
        r"authors\.$",
        setup=plugin(
            """
            def build(options, context):
                raise ConnectionError("tracker unreachable")

            @hookimpl
            def forge_lm_register_metrics_backends(register):
                register("hostile", build, description="A backend that cannot be built")
            """
        ),
        check=nothing_written,
    ),
    Case(
        "metrics-jsonl-is-a-directory",
        TRAIN,
        0,
        r"forge: warning: metrics backend 'jsonl' \(forge-lm [^)]+\) failed in start: IsADirectoryError: \[Errno 21\] "
        r"Is a directory: .*; it is off for the rest of this run",
        setup=blocked_metrics_file,
        check=completed_without_metrics,
    ),
    # -- plugins that do not load, or register something broken -------------------------------------------
    Case(
        "import-fails-run-does-not-need-it",
        TRAIN,
        0,
        rf"forge: warning: {PLUGIN} is broken and not used by this run: import failed: RuntimeError: no GPU here$",
        setup=plugin("raise RuntimeError('no GPU here')"),
        check=completed,
    ),
    Case(
        "import-fails-run-needs-it",
        (*TRAIN, "--loss.name=hostile_loss"),
        2,
        r"forge: error: \[loss\] name = 'hostile_loss': unknown loss 'hostile_loss'\.$",
        setup=plugin("raise RuntimeError('no GPU here')"),
        check=lambda ws, outcome: (
            nothing_written(ws, outcome),
            assert_in("plugin 'hostile' (forge-hostile 1.0) is installed but broken: import failed", outcome.stderr),
        ),
    ),
    Case(
        "registers-an-invalid-component",
        TRAIN,
        0,
        rf"forge: warning: {PLUGIN} is broken and not used by this run: component name 'Bad Name' is invalid: ",
        setup=hook("forge_lm_register_losses", "register", "register('Bad Name', 'x:y', description='bad')"),
        check=completed,
    ),
    Case(
        "component-factory-module-missing",
        (*TRAIN, "--loss.name=hostile_loss"),
        2,
        rf"forge: error: loss 'hostile_loss' from {PLUGIN} cannot be built: importing 'forge_hostile_missing:build' "
        r"failed with ModuleNotFoundError",
        setup=hook(
            "forge_lm_register_losses",
            "register",
            "register('hostile_loss', 'forge_hostile_missing:build', description='x')",
        ),
        check=nothing_written,
    ),
    Case(
        "component-factory-raises",
        (*TRAIN, "--loss.name=hostile_loss"),
        2,
        rf"forge: error: loss 'hostile_loss' from {PLUGIN} could not be built: ZeroDivisionError: division by zero\.",
        setup=hook(
            "forge_lm_register_losses", "register", "register('hostile_loss', lambda options: 1 / 0, description='x')"
        ),
        check=nothing_written,
    ),
    # -- a factory returns something that is not its category's component: named where it is built ------
    Case(
        "optimizer-factory-returns-none",
        (*TRAIN, "--optimizer.name=hostile_opt"),
        2,
        rf"forge: error: optimizer 'hostile_opt' from {PLUGIN} cannot be used: its factory returned None, not a "
        r"torch\.optim\.Optimizer\. This is a bug in forge-hostile 1\.0: report it to its authors, or choose another "
        r"optimizer\.$",
        setup=hook(
            "forge_lm_register_optimizers",
            "register",
            "register('hostile_opt', lambda options, model: None, description='x')",
        ),
        check=nothing_written,
    ),
    Case(
        "scheduler-factory-returns-none",
        (*TRAIN, "--scheduler.name=hostile_sched"),
        2,
        rf"forge: error: scheduler 'hostile_sched' from {PLUGIN} cannot be used: its factory returned None; the "
        r"core needs a scheduler with step\(\), state_dict\(\) and load_state_dict\(state\)",
        setup=hook(
            "forge_lm_register_schedulers",
            "register",
            "register('hostile_sched', lambda options, optimizer, total: None, description='x')",
        ),
        check=nothing_written,
    ),
    Case(
        "loss-factory-returns-none",
        (*TRAIN, "--loss.name=hostile_loss"),
        2,
        rf"forge: error: loss 'hostile_loss' from {PLUGIN} cannot be used: its factory returned None, not a "
        r"callable loss_fn",
        setup=hook(
            "forge_lm_register_losses", "register", "register('hostile_loss', lambda options: None, description='x')"
        ),
        check=nothing_written,
    ),
    Case(
        "dataset-factory-returns-a-list",
        (*TRAIN, "--data.name=hostile_data"),
        2,
        rf"forge: error: dataset 'hostile_data' from {PLUGIN} cannot be used: its factory returned a list without "
        r"state_dict\(\), load_state_dict\(\);",
        setup=hook(
            "forge_lm_register_datasets",
            "register",
            "register('hostile_data', lambda options, context: [], description='x')",
        ),
        check=nothing_written,
    ),
    # -- a loss function returns something that is not a 0-d floating tensor: exit 4 ---------------------
    Case(
        "loss-returns-none",
        (*TRAIN, "--loss.name=hostile_loss"),
        4,
        rf"forge: error: {PLUGIN} returned None from its loss 'hostile_loss'; the core needs a 0-d floating tensor "
        r".*Training stopped at step 0; no checkpoint was written yet\. Fix the plugin or run without it \(set another "
        r"\[loss\] name\), then run the same command to resume\.$",
        setup=hook(
            "forge_lm_register_losses",
            "register",
            "register('hostile_loss', lambda options: lambda logits, labels: None, description='x')",
        ),
        check=nothing_saved,
    ),
    Case(
        "loss-returns-a-per-token-vector-at-step-3",
        (*TRAIN, "--loss.name=hostile_loss"),
        4,
        rf"forge: error: {PLUGIN} returned a tensor of shape \[32\] and dtype float32 from its loss 'hostile_loss'; .*"
        r"Training stopped at step 2; the newest checkpoint \(step_2\) is intact\.",
        setup=plugin(
            """
            import torch.nn.functional as F

            calls = []

            def loss(logits, labels):
                calls.append(1)
                per_token = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
                return per_token if len(calls) == 3 else per_token.mean()

            @hookimpl
            def forge_lm_register_losses(register):
                register("hostile_loss", lambda options: loss, description="x")
            """
        ),
        check=stopped_at(2, [1, 2]),
    ),
    # -- model transforms: every installed one takes part in every run, so a failing one is named ---------
    Case(
        "transform-enabled-raises-on-a-plain-run",
        TRAIN,
        2,
        rf"forge: error: model transform 'hostile_tr' of {PLUGIN} failed in enabled\(\): RuntimeError: kaput\. This "
        r"is a bug in forge-hostile 1\.0: report it to its authors, or run without the plugin \(--block-plugin "
        r"hostile\)\.$",
        setup=plugin(
            """
            from forge_lm.distributed import ModelTransform

            def enabled(context):
                raise RuntimeError("kaput")

            def noop(model, context):
                pass

            @hookimpl
            def forge_lm_register_model_transforms(register):
                register("hostile_tr", lambda options: ModelTransform("compile", enabled, noop), description="x")
            """
        ),
        check=nothing_written,
    ),
    Case(
        "transform-enabled-returns-a-string",
        TRAIN,
        2,
        rf"forge: error: model transform 'hostile_tr' of {PLUGIN}: enabled\(\) returned str, not a bool\. .*"
        r"--block-plugin hostile",
        setup=plugin(
            """
            from forge_lm.distributed import ModelTransform

            def answer(context):
                return "no"

            def noop(model, context):
                pass

            @hookimpl
            def forge_lm_register_model_transforms(register):
                register("hostile_tr", lambda options: ModelTransform("compile", answer, noop), description="x")
            """
        ),
        check=nothing_written,
    ),
    Case(
        "transform-apply-raises-on-a-plain-run",
        TRAIN,
        2,
        rf"forge: error: model transform 'hostile_tr' of {PLUGIN} failed in apply\(\): RuntimeError: kaput\. .*"
        r"--block-plugin hostile",
        setup=plugin(
            """
            from forge_lm.distributed import ModelTransform

            def apply(model, context):
                raise RuntimeError("kaput")

            @hookimpl
            def forge_lm_register_model_transforms(register):
                register("hostile_tr", lambda options: ModelTransform("compile", bool, apply), description="x")
            """
        ),
        check=nothing_written,
    ),
    Case(
        "transform-factory-raises-on-a-plain-run",
        TRAIN,
        2,
        rf"forge: error: model transform 'hostile_tr' from {PLUGIN} could not be built: ZeroDivisionError: division by "
        r"zero\. .*Or run without the plugin \(--block-plugin hostile\)\.$",
        setup=hook(
            "forge_lm_register_model_transforms",
            "register",
            "register('hostile_tr', lambda options: 1 / 0, description='x')",
        ),
        check=nothing_written,
    ),
    # -- an evaluator raises: stopped like a failing eval_end hook, the evaluated step saved ---------------
    Case(
        "evaluator-raises-at-its-first-evaluation",
        (*TRAIN, "--eval.interval=3", "--eval.steps=1", '--eval.evaluators=["hostile_eval"]'),
        4,
        rf"forge: error: {PLUGIN} raised in evaluate\(\) of its evaluator 'hostile_eval' at step 3: RuntimeError: "
        r"kaput\. Training stopped at step 3 after saving a checkpoint of that step, which is intact\. Fix the plugin "
        r"or run without it \(remove 'hostile_eval' from \[eval\] evaluators\), then run the same command to resume\.$",
        setup=plugin(
            """
            class Evaluator:
                def evaluate(self, model, step):
                    raise RuntimeError("kaput")

            @hookimpl
            def forge_lm_register_evaluators(register):
                register("hostile_eval", lambda options, context: Evaluator(), description="x")
            """
        ),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "incompatible-plugin",
        TRAIN,
        0,
        rf"forge: warning: {PLUGIN} is incompatible and not used by this run: supports plugin API >=2,<3 but this "
        rf"core provides {re.escape(PLUGIN_API_VERSION)}",
        setup=plugin("@hookimpl\ndef forge_lm_step_end():\n    raise ValueError('must never run')\n", api='">=2,<3"'),
        check=completed,
    ),
    Case(
        "configure-crashes",
        TRAIN,
        2,
        rf"forge: error: {PLUGIN} failed while checking the config: AttributeError: .*--block-plugin hostile\)\.$",
        setup=hook("forge_lm_configure", "config", "return config.no_such_section"),
        check=nothing_written,
    ),
    # -- a dataset's or scheduler's state_dict() that a resume could not load: exit 4 at that save ---------
    # Saved, it would make every checkpoint of the run unusable; the save is refused instead, the one
    # before it intact (train.run_state.save_run).
    Case(
        "dataset-state-changes-shape",
        (*TRAIN, "--data.name=hostile_data"),
        4,
        rf"forge: error: {PLUGIN} provides the dataset 'hostile_data', whose state at step 4 a resume could not "
        r"load: state_dict\(\)\.last is not a boolean .*Rule: a state_dict must keep the shape it had when the "
        r"component was built: same keys, same kinds of values\. Training stopped at step 4; the newest checkpoint "
        rf"\(step_2\) is intact\. {STOPPED}",
        setup=plugin(
            """
            from forge_lm.data.synthetic import SyntheticTokens

            class Data(SyntheticTokens):  # "last" is None up to the first save (4 samples), then an int
                def state_dict(self):
                    return {"next_index": self._start, "last": None if self._start <= 4 else self._start}

            @hookimpl
            def forge_lm_register_datasets(register):
                register("hostile_data", lambda options, context: Data(context), description="x")
            """
        ),
        check=stopped_at(2, [1, 2, 3, 4]),
    ),
    Case(
        "dataset-state-holds-a-set",
        (*TRAIN, "--data.name=hostile_data"),
        4,
        rf"forge: error: {PLUGIN} provides the dataset 'hostile_data', whose state at step 2 a resume could not "
        r"load: state_dict\(\)\.seen is a set\. Rule: a state_dict must be plain JSON data",
        setup=plugin(
            """
            from forge_lm.data.synthetic import SyntheticTokens

            class Data(SyntheticTokens):
                def state_dict(self):
                    return {"next_index": self._start, "seen": {1, 2}}

            @hookimpl
            def forge_lm_register_datasets(register):
                register("hostile_data", lambda options, context: Data(context), description="x")
            """
        ),
        check=lambda ws, outcome: (nothing_saved(ws, outcome), assert_no_step_written(ws)),
    ),
    Case(
        "scheduler-state-dict-returns-none",
        (*TRAIN, "--scheduler.name=hostile_schedule"),
        4,
        rf"forge: error: {PLUGIN} provides the scheduler 'hostile_schedule', whose state at step 2 a resume could "
        r"not load: state_dict\(\) is a NoneType, not a dict\. .*Training stopped at step 2; no checkpoint was "
        rf"written yet\. {STOPPED}",
        setup=plugin(
            """
            import torch

            class Schedule(torch.optim.lr_scheduler.LambdaLR):
                def state_dict(self):
                    return None

            @hookimpl
            def forge_lm_register_schedulers(register):
                register("hostile_schedule", lambda options, opt, total: Schedule(opt, lambda s: 1.0), description="x")
            """
        ),
        check=lambda ws, outcome: (nothing_saved(ws, outcome), assert_no_step_written(ws)),
    ),
]


def assert_second_forge_line(outcome: Outcome, pattern: str) -> None:
    lines = [line for line in outcome.stderr.splitlines() if line.startswith("forge:")]
    assert len(lines) >= 2, outcome.stderr
    assert re.match(pattern, lines[1]), outcome.stderr


def assert_each_step_has(ws: Workspace, key: str, value: float) -> None:
    assert [r[key] for r in records(ws) if "loss" in r] == [value] * 4


def assert_losses_positive(ws: Workspace) -> None:
    assert all(r["loss"] > 0 for r in records(ws) if "loss" in r)


def assert_in(text: str, stderr: str) -> None:
    assert text in stderr, stderr


def assert_no_step_written(ws: Workspace) -> None:
    """Not even a partial step directory: the refused save wrote nothing."""
    assert not list(ws.checkpoints.glob("step_*")), sorted(p.name for p in ws.checkpoints.iterdir())


@pytest.fixture
def plugin_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The case's plugin site (``<root>/site``) on ``sys.path``; its modules forgotten afterwards."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))  # also invalidates importlib's caches
    yield site
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(site)):
            del sys.modules[name]
    importlib.invalidate_caches()


@pytest.mark.parametrize("case", case_params(CASES))
def test_case(case, run_case, plugin_site):
    run_case(case)


def test_the_table_covers_every_lifecycle_hook():
    hooks = " ".join(case.first_line for case in CASES)
    for name in ("train_start", "step_end", "eval_end", "save_state", "load_state", "train_end"):
        assert f"forge_lm_{name}" in hooks
    assert len(CASES) >= 18
