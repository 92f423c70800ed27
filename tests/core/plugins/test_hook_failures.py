"""A plugin's hook that fails, or returns garbage, and a metrics backend that fails.

Every lifecycle hook goes through the manager's one calling path, which names the plugin
(name, distribution, version) and the hook. A failing training hook stops the run with exit
code 4 after checkpointing the last completed step; train_end and metrics backends fail
with a warning only. The policy is documented in ``forge_lm.hookspecs``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

import forge_lm.cli._main as cli_main
from forge_lm import hookimpl
from forge_lm.config import load_config
from forge_lm.errors import PluginError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginManager, PluginSettings, PluginStatus
from forge_lm.plugins._calls import PLUGIN_HOOK_EXIT_CODE, PluginHookFailed
from forge_lm.testing import TINY_MODEL
from forge_lm.train import train
from forge_lm.train.resilience import NonFiniteLoss

TINY = (
    *TINY_MODEL,
    "--train.batch_size=2",
    "--train.seq_len=16",
    "--train.max_steps=4",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--data.name=synthetic",
    "--checkpoint.interval=2",
)
LABEL = "plugin 'faults' (forge-faults 1.0)"


class Faults:
    """Implements every lifecycle hook; ``fail`` names the hook that raises ``error``, at
    step ``at`` (any step when None). Saves ``{"step": n}`` so that load_state runs on resume."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self, fail: str | None = None, at: int | None = None, error: BaseException | None = None):
        self.fail, self.at = fail, at
        self.error = error if error is not None else ValueError("boom")
        self.calls: list[tuple] = []

    def _maybe(self, hook: str, step: int) -> None:
        self.calls.append((hook, step))
        if hook == self.fail and (self.at is None or step == self.at):
            raise self.error

    @hookimpl
    def forge_lm_train_start(self, context):
        self._maybe("train_start", context.step)

    @hookimpl
    def forge_lm_step_end(self, step):
        self._maybe("step_end", step)
        return {"faults/step": float(step)}

    @hookimpl
    def forge_lm_eval_end(self, step):
        self._maybe("eval_end", step)
        return {"faults/eval": 1.0}

    @hookimpl
    def forge_lm_save_state(self, context):
        self._maybe("save_state", context.step)
        return {"step": context.step}

    @hookimpl
    def forge_lm_load_state(self, context, state):
        self._maybe("load_state", context.step)

    @hookimpl
    def forge_lm_train_end(self, status):
        self.calls.append(("train_end", status))
        if self.fail == "train_end":
            raise self.error


class Returns:
    """A plugin whose step_end and eval_end return ``value``."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self, value):
        self.value = value

    @hookimpl
    def forge_lm_step_end(self):
        return self.value

    @hookimpl
    def forge_lm_eval_end(self):
        return self.value


class FailingBackend:
    """A metrics backend raising OSError in ``fail`` (start, log from step ``at``, finish)."""

    def __init__(self, fail: str, at: int = 0):
        self.fail, self.at = fail, at
        self.logged: list[int] = []
        self.finished = 0

    def start(self, config, manifest):
        if self.fail == "start":
            raise OSError(28, "No space left on device")

    def log(self, step, metrics):
        if self.fail == "log" and step >= self.at:
            raise OSError(28, "No space left on device")
        self.logged.append(step)

    def finish(self, summary):
        self.finished += 1
        if self.fail == "finish":
            raise OSError(28, "No space left on device")


class BackendPlugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self, factory):
        self.factory = factory

    @hookimpl
    def forge_lm_register_metrics_backends(self, register):
        register("flaky", self.factory, description="A backend that fails")


def faulty_manager(*plugins: tuple[str, object]) -> PluginManager:
    manager = PluginManager(PluginSettings(autoload=False), entry_points=False)
    for name, plugin in plugins:
        manager.add_plugin(plugin, name, distribution=f"forge-{name}", version="1.0")
    return manager


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def forge(monkeypatch, run_dir, capsys):
    """``forge(manager, *overrides)``: ``forge train`` in-process with the tiny run into
    ``run_dir`` and ``manager``'s plugins; returns (exit code, stderr)."""

    def run(manager: PluginManager, *overrides: str) -> tuple[int, str]:
        monkeypatch.setattr(cli_main, "plugin_manager", lambda args: manager)
        capsys.readouterr()
        code = cli_main.main(["train", *TINY, f"--train.output_dir={run_dir}", *overrides])
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return code, err

    return run


def config_for(manager: PluginManager, run_dir: Path, *overrides: str):
    return load_config(None, [*TINY, f"--train.output_dir={run_dir}", *overrides], manager.registry)


def latest(run_dir: Path) -> str | None:
    pointer = run_dir / "checkpoints" / "latest"
    return pointer.read_text().strip() if pointer.exists() else None


def logged_steps(run_dir: Path, key: str = "loss") -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if key in r]


def first_forge_line(err: str) -> str:
    return next((line for line in err.splitlines() if line.startswith("forge:")), "")


# -- the calling path ---------------------------------------------------------------------------


def test_a_failure_names_the_plugin_its_distribution_version_and_the_hook():
    manager = faulty_manager(("faults", Faults("train_start")))

    with pytest.raises(PluginHookFailed) as caught:
        manager.call("forge_lm_train_start", context=type("Ctx", (), {"step": 0})())

    failure = caught.value
    assert failure.headline == f"{LABEL} raised in forge_lm_train_start: ValueError: boom"
    assert (failure.plugin.name, failure.hook) == ("faults", "forge_lm_train_start")
    assert isinstance(failure.__cause__, ValueError)
    assert str(failure) == (
        f"{LABEL} raised in forge_lm_train_start: ValueError: boom. This is a bug in the plugin: report it to "
        "its authors, or run without it (--block-plugin faults)."
    )


def test_implementations_are_called_in_pluggys_order_and_results_collected_like_pluggy():
    class Answer:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        def __init__(self, value):
            self.value = value

        @hookimpl
        def forge_lm_step_end(self):
            return self.value

    manager = faulty_manager(("a", Answer({"a": 1.0})), ("b", Answer(None)), ("c", Answer({"c": 2.0})))

    ours = [result for _, result in manager.call("forge_lm_step_end", context=None, step=1, metrics={})]

    assert ours == manager.hook.forge_lm_step_end(context=None, step=1, metrics={})
    assert ours == [{"c": 2.0}, {"a": 1.0}]  # pluggy calls the last registered first


def test_the_first_failure_stops_the_call_and_later_implementations_do_not_run():
    first, second = Faults("train_start"), Faults()
    manager = faulty_manager(("second", second), ("faults", first))  # "faults" registered last: runs first

    with pytest.raises(PluginHookFailed, match=r"^plugin 'faults'"):
        manager.call("forge_lm_train_start", context=type("Ctx", (), {"step": 0})())

    assert first.calls == [("train_start", 0)]
    assert second.calls == []


@pytest.mark.parametrize(
    ("error", "described"),
    [
        (SystemExit(3), "SystemExit: 3"),
        (type("Custom", (BaseException,), {})("odd"), "Custom: odd"),
        (RuntimeError(), "RuntimeError"),
        (ValueError("two\n  lines"), "ValueError: two lines"),
    ],
)
def test_every_exception_but_keyboard_interrupt_is_the_plugins_failure(error, described):
    manager = faulty_manager(("faults", Faults("train_start", error=error)))

    with pytest.raises(PluginHookFailed) as caught:
        manager.call("forge_lm_train_start", context=type("Ctx", (), {"step": 0})())

    assert caught.value.headline == f"{LABEL} raised in forge_lm_train_start: {described}"


def test_keyboard_interrupt_in_a_hook_passes_through_as_the_users_ctrl_c():
    manager = faulty_manager(("faults", Faults("train_start", error=KeyboardInterrupt())))

    with pytest.raises(KeyboardInterrupt):
        manager.call("forge_lm_train_start", context=type("Ctx", (), {"step": 0})())


def test_call_quietly_warns_naming_the_plugin_and_still_calls_the_others(capsys):
    quiet = Faults()
    manager = faulty_manager(("quiet", quiet), ("faults", Faults("train_end")))

    manager.call_quietly("forge_lm_train_end", context=None, status="completed")

    assert capsys.readouterr().err == (
        f"forge: warning: {LABEL} raised in forge_lm_train_end: ValueError: boom; the run's outcome stands\n"
    )
    assert quiet.calls == [("train_end", "completed")]


def test_call_first_returns_the_first_answer_and_names_a_failing_plugin():
    class Exporter:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        def __init__(self, answer):
            self.answer = answer

        @hookimpl
        def forge_lm_hf_export(self, model, config):
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    manager = faulty_manager(("late", Exporter(({"late": 1}, {}))), ("none", Exporter(None)))
    assert manager.call_first("forge_lm_hf_export", model=None, config=None) == ({"late": 1}, {})

    manager.add_plugin(Exporter(KeyError("w1")), "faults", distribution="forge-faults", version="1.0")
    with pytest.raises(PluginHookFailed, match=re.escape(f"{LABEL} raised in forge_lm_hf_export: KeyError: 'w1'")):
        manager.call_first("forge_lm_hf_export", model=None, config=None)


def test_a_plugin_implementing_a_hook_wrapper_is_broken():
    class Wrapper:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl(wrapper=True)
        def forge_lm_step_end(self):
            return (yield)

    manager = faulty_manager(("wrapper", Wrapper()))

    plugin = manager.plugin("wrapper")
    assert plugin.status is PluginStatus.BROKEN
    assert plugin.reason.startswith("implements forge_lm_step_end as a hook wrapper;")
    assert manager.hook.forge_lm_step_end.get_hookimpls() == []


def test_a_plugin_exiting_in_configure_is_a_plugin_error_naming_it():
    class Exits:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl
        def forge_lm_configure(self):
            raise SystemExit(0)

    manager = faulty_manager(("faults", Exits()))

    with pytest.raises(PluginError, match=re.escape(f"{LABEL} failed while checking the config: SystemExit: 0.")):
        manager.configure(object())


# -- untrusted return values ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("returned", "kept", "problem"),
    [
        ("a string", {}, "a str instead of a dict of metric names to numbers"),
        ([1.0, 2.0], {}, "a list instead of a dict of metric names to numbers"),
        (float("nan"), {}, "a float instead of a dict of metric names to numbers"),
        ({1: 2.0, "ok": 3}, {"ok": 3.0}, "key 1 is not a non-empty string"),
        ({"": 1.0}, {}, "key '' is not a non-empty string"),
        ({"x": "1.0", "ok": 1.5}, {"ok": 1.5}, "'x' is a str, not a number"),
        ({"x": None}, {}, "'x' is a NoneType, not a number"),
        ({"x": True}, {}, "'x' is a bool, not a number"),
        ({"x": [1.0]}, {}, "'x' is a list, not a number"),
        ({"x": torch.tensor(1.0)}, {}, "'x' is a Tensor, not a number (call .item() on it)"),
        ({"x": 10**400}, {}, "'x' is not a float (OverflowError: int too large to convert to float)"),
        ({"loss": 0.0}, {}, "'loss' would overwrite the core's own metric"),
        ({"step": 7}, {}, "'step' would overwrite the core's own metric"),
        ({"mfu": 1.0}, {}, "'mfu' would overwrite the core's own metric"),
    ],
)
def test_garbage_returned_from_step_end_is_left_out_with_one_warning(capsys, returned, kept, problem):
    manager = faulty_manager(("faults", Returns(returned)))

    for step in (1, 2):
        assert manager.collect_metrics("forge_lm_step_end", context=None, step=step, metrics={"loss": 1.0}) == kept

    assert capsys.readouterr().err == (
        f"forge: warning: {LABEL} returned unusable metrics from forge_lm_step_end: {problem}. They are left out "
        "(this warning is not repeated); the run goes on.\n"
    )


def test_numbers_nan_and_inf_are_accepted_as_floats(capsys):
    manager = faulty_manager(("faults", Returns({"a": 1, "b": float("nan"), "c": -math.inf})))

    merged = manager.collect_metrics("forge_lm_eval_end", context=None, step=1, metrics={"eval/loss": 2.0})

    assert merged["a"] == 1.0
    assert type(merged["a"]) is float
    assert math.isnan(merged["b"])
    assert merged["c"] == -math.inf
    assert capsys.readouterr().err == ""


def test_each_plugin_gets_its_own_copy_of_the_metrics():
    class Mutates:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        def __init__(self):
            self.seen = []

        @hookimpl
        def forge_lm_step_end(self, metrics):
            self.seen.append(dict(metrics))
            metrics["loss"] = -1.0

    first, second = Mutates(), Mutates()
    manager = faulty_manager(("first", first), ("second", second))
    given = {"loss": 1.0}

    manager.collect_metrics("forge_lm_step_end", context=None, step=1, metrics=given)

    assert first.seen == second.seen == [{"loss": 1.0}]
    assert given == {"loss": 1.0}


def _nested(levels: int) -> list:
    """A list ``levels`` lists deep: ``[[...[]...]]``."""
    nested: list = []
    for _ in range(levels - 1):
        nested = [nested]
    return nested


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        (object(), "'state' is a object; checkpoints keep tensors and plain data only"),
        ({"a": {"b": {1, 2}}}, "'state['a']['b']' is a set; checkpoints keep tensors and plain data only"),
        ({(1, 2): 3}, "'state' has the key (1, 2), not a string or an integer"),
        ({"k": _nested(65)}, "'state['k']" + "[0]" * 63 + "' is nested more than 64 levels deep"),
    ],
)
def test_a_state_a_checkpoint_cannot_keep_is_the_plugins_failure(state, problem):
    class Saves:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl
        def forge_lm_save_state(self):
            return state

    manager = faulty_manager(("faults", Saves()))

    with pytest.raises(PluginHookFailed) as caught:
        manager.save_states(None)

    assert caught.value.headline == f"{LABEL} returned a state from forge_lm_save_state that cannot be saved: {problem}"


def test_a_self_referencing_state_is_refused_not_a_recursion_error():
    looped: list = []
    looped.append(looped)

    class Saves:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl
        def forge_lm_save_state(self):
            return {"loop": looped}

    with pytest.raises(PluginHookFailed, match=r"'state\['loop'\]\[0\]' contains itself \(a cycle\)"):
        faulty_manager(("faults", Saves())).save_states(None)


def test_plain_data_and_tensors_are_kept():
    state = {"n": 1, "x": [1.5, None, "s", (True, 2)], "t": torch.zeros(2), 3: {"k": "v"}}

    class Saves:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl
        def forge_lm_save_state(self):
            return state

    assert faulty_manager(("keeper", Saves())).save_states(None) == {"keeper": state}


def test_a_load_state_failure_names_the_plugin():
    manager = faulty_manager(("faults", Faults("load_state")))

    with pytest.raises(PluginHookFailed, match=re.escape(f"{LABEL} raised in forge_lm_load_state: ValueError: boom")):
        manager.load_states(type("Ctx", (), {"step": 2})(), {"faults": {"step": 2}})


# -- training: a failing hook stops the run with exit 4, the last step saved ----------------------------


def test_step_end_failure_exits_4_after_logging_and_checkpointing_the_step(forge, run_dir):
    faults = Faults("step_end", at=3)

    code, err = forge(faulty_manager(("faults", faults)))

    assert code == PLUGIN_HOOK_EXIT_CODE == 4
    assert first_forge_line(err) == (
        f"forge: error: {LABEL} raised in forge_lm_step_end: ValueError: boom. Training stopped at step 3 after "
        "saving a checkpoint of that step, which is intact. Fix the plugin or run without it (--block-plugin "
        "faults), then run the same command to resume."
    )
    assert latest(run_dir) == "step_3"
    assert logged_steps(run_dir) == [1, 2, 3]  # the step that finished is not lost
    assert faults.calls[-1] == ("train_end", "failed")
    state = json.loads((run_dir / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert state["step"] == 3


def test_after_the_failure_the_same_command_resumes_from_the_saved_step(forge, run_dir, capsys):
    assert forge(faulty_manager(("faults", Faults("step_end", at=3))))[0] == 4

    code, err = forge(faulty_manager(("faults", Faults())))

    assert code == 0, err
    assert "(step 3)" in err
    assert logged_steps(run_dir) == [1, 2, 3, 4]


def test_eval_end_failure_logs_the_evaluation_and_checkpoints_its_step(forge, run_dir):
    code, err = forge(faulty_manager(("faults", Faults("eval_end"))), "--eval.interval=3", "--eval.steps=1")

    assert code == 4
    assert f"{LABEL} raised in forge_lm_eval_end: ValueError: boom. Training stopped at step 3 after saving" in err
    assert latest(run_dir) == "step_3"
    assert logged_steps(run_dir, "eval/loss") == [3]
    assert logged_steps(run_dir) == [1, 2, 3]


def test_save_state_failure_saves_nothing_and_the_previous_checkpoint_stays(forge, run_dir):
    code, err = forge(faulty_manager(("faults", Faults("save_state", at=4))))

    assert code == 4
    assert first_forge_line(err) == (
        f"forge: error: {LABEL} raised in forge_lm_save_state: ValueError: boom. Training stopped at step 4; the "
        "newest checkpoint (step_2) is intact. Fix the plugin or run without it (--block-plugin faults), then "
        "run the same command to resume."
    )
    assert latest(run_dir) == "step_2"
    assert not (run_dir / "checkpoints" / "step_4").exists()


def test_a_second_failure_while_saving_is_reported_and_the_first_stands(forge, run_dir):
    class AlsoSave(Faults):
        @hookimpl
        def forge_lm_save_state(self, context):
            if context.step == 3:
                raise OSError("the plugin's disk is gone")
            return None

    code, err = forge(faulty_manager(("faults", AlsoSave("step_end", at=3))))

    assert code == 4
    assert (
        f"{LABEL} raised in forge_lm_step_end: ValueError: boom. Training stopped at step 3; saving a checkpoint "
        f"of that step failed too ({LABEL} raised in forge_lm_save_state: OSError: the plugin's disk is gone); "
        "the newest checkpoint (step_2) is intact." in err
    )
    assert latest(run_dir) == "step_2"


def test_train_start_failure_on_a_fresh_run_writes_no_checkpoint(forge, run_dir):
    faults = Faults("train_start")

    code, err = forge(faulty_manager(("faults", faults)))

    assert code == 4
    assert f"{LABEL} raised in forge_lm_train_start: ValueError: boom. Training stopped at step 0; no checkpoint" in err
    assert not (run_dir / "checkpoints").exists() or latest(run_dir) is None
    assert faults.calls == [("train_start", 0), ("train_end", "failed")]


def test_load_state_failure_on_resume_exits_4_and_changes_no_checkpoint(forge, run_dir):
    assert forge(faulty_manager(("faults", Faults())), "--train.max_steps=2")[0] == 0
    before = (run_dir / "checkpoints" / "step_2" / "trainer_state.json").read_bytes()
    faults = Faults("load_state")

    code, err = forge(faulty_manager(("faults", faults)), "--train.max_steps=2")

    assert code == 4
    assert (
        f"{LABEL} raised in forge_lm_load_state: ValueError: boom. Training stopped at step 2; the newest "
        "checkpoint (step_2) is intact." in err
    )
    assert (run_dir / "checkpoints" / "step_2" / "trainer_state.json").read_bytes() == before
    assert faults.calls == [("load_state", 2)]  # neither train_start nor train_end ran


def test_sys_exit_in_a_hook_is_a_plugin_failure_not_the_end_of_the_process(forge, run_dir):
    code, err = forge(faulty_manager(("faults", Faults("step_end", at=1, error=SystemExit(0)))))

    assert code == 4
    assert f"{LABEL} raised in forge_lm_step_end: SystemExit: 0. Training stopped at step 1 after saving" in err
    assert latest(run_dir) == "step_1"


def test_keyboard_interrupt_raised_by_a_hook_without_a_ctrl_c_is_the_plugins_failure(forge, run_dir):
    # No SIGINT reached the process: the plugin raised it itself, so it is the plugin's failure
    # (exit 4, the finished step saved), not the user's interruption (130).
    faults = Faults("step_end", at=3, error=KeyboardInterrupt())

    code, err = forge(faulty_manager(("faults", faults)))

    assert code == 4
    assert first_forge_line(err).startswith(f"forge: error: {LABEL} raised in forge_lm_step_end: KeyboardInterrupt")
    assert latest(run_dir) == "step_3"
    assert faults.calls[-1] == ("train_end", "failed")


def test_with_sigint_ignored_a_hooks_keyboard_interrupt_is_still_the_plugins_failure(forge, run_dir):
    # A background job of a non-interactive shell (nohup forge train ... &) ignores SIGINT: no
    # Ctrl-C can arrive, so a KeyboardInterrupt is the plugin's own (exit 4), not the user's (130).
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code, err = forge(faulty_manager(("faults", Faults("step_end", at=2, error=KeyboardInterrupt()))))
    finally:
        signal.signal(signal.SIGINT, previous)

    assert code == 4
    assert first_forge_line(err).startswith(f"forge: error: {LABEL} raised in forge_lm_step_end: KeyboardInterrupt")
    assert latest(run_dir) == "step_2"


# -- train_end: a warning; the run's outcome stands ---------------------------------------------------


def test_train_end_failure_after_a_completed_run_is_a_warning_and_exit_0(forge, run_dir):
    code, err = forge(faulty_manager(("faults", Faults("train_end"))))

    assert code == 0
    assert first_forge_line(err) == (
        f"forge: warning: {LABEL} raised in forge_lm_train_end: ValueError: boom; the run's outcome stands"
    )
    assert latest(run_dir) == "step_4"


def test_train_end_failure_after_a_failed_run_leaves_the_original_error_and_exit_code(forge, run_dir):
    class BothFail(Faults):
        @hookimpl
        def forge_lm_train_end(self, status):
            raise RuntimeError("cleanup failed")

    code, err = forge(faulty_manager(("faults", BothFail("step_end", at=3))))

    assert code == 4
    lines = [line for line in err.splitlines() if line.startswith("forge:")]
    assert lines[0].startswith(f"forge: warning: {LABEL} raised in forge_lm_train_end: RuntimeError: cleanup failed")
    assert lines[1].startswith(f"forge: error: {LABEL} raised in forge_lm_step_end: ValueError: boom.")


def test_nothing_raised_while_the_run_ends_replaces_the_error_that_ended_it(run_dir):
    manager = faulty_manager(
        ("faults", Faults("train_end", error=SystemExit(9))),
        ("flaky", BackendPlugin(lambda options, context: FailingBackend("finish"))),
    )
    config = config_for(manager, run_dir, '--metrics.backends=["jsonl", "flaky"]', "--resilience.nan_policy=stop")
    manager.add_plugin(NanAtStep(2), "nan")

    with pytest.raises(NonFiniteLoss):
        train(config, manager)


class NanAtStep:
    """Makes the loss non-finite from step ``at`` on, through the gradients: a step_end that
    poisons a parameter."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self, at: int):
        self.at = at

    @hookimpl
    def forge_lm_step_end(self, context, step):
        if step == self.at - 1:
            with torch.no_grad():
                next(context.model.parameters()).fill_(float("nan"))


# -- metrics backends: one that fails is turned off with one warning; training goes on -----------------


@pytest.mark.parametrize(
    ("fail", "what", "logged"),
    [
        ("start", "start", []),
        ("log", "log (step 2)", [1]),
        ("finish", "finish", [1, 2, 3, 4]),
    ],
)
def test_a_failing_backend_is_turned_off_with_one_warning_and_the_others_go_on(forge, run_dir, fail, what, logged):
    backend = FailingBackend(fail, at=2)
    manager = faulty_manager(("flaky", BackendPlugin(lambda options, context: backend)))

    code, err = forge(manager, '--metrics.backends=["flaky", "jsonl"]')

    assert code == 0, err
    then = (
        "what it logged before may be incomplete"
        if fail == "finish"
        else "it is off for the rest of this run; training and the other metrics backends go on"
    )
    warnings = [line for line in err.splitlines() if line.startswith("forge: warning:")]
    assert warnings == [
        f"forge: warning: metrics backend 'flaky' (forge-flaky 1.0) failed in {what}: OSError: [Errno 28] No space "
        f"left on device; {then}"
    ]
    assert backend.logged == logged
    assert backend.finished == 1  # still closed at the end
    assert logged_steps(run_dir) == [1, 2, 3, 4]  # jsonl has every step
    assert latest(run_dir) == "step_4"


def test_an_unwritable_metrics_file_is_a_warning_and_the_checkpoints_are_still_written(forge, run_dir):
    (run_dir / "metrics.jsonl").mkdir(parents=True)
    (run_dir / "checkpoints").mkdir()  # a run's directory, not a stranger's folder (which a run refuses)

    code, err = forge(faulty_manager())

    assert code == 0, err
    assert re.match(
        r"forge: warning: metrics backend 'jsonl' \(forge-lm [^)]+\) failed in start: IsADirectoryError: \[Errno 21\] "
        r"Is a directory: '.*metrics\.jsonl'; it is off for the rest of this run",
        first_forge_line(err),
    )
    assert latest(run_dir) == "step_4"


def test_a_backend_whose_factory_raises_stops_the_run_before_anything_is_written(forge, run_dir):
    def factory(options, context):
        raise ValueError("no such project")

    code, err = forge(faulty_manager(("flaky", BackendPlugin(factory))), '--metrics.backends=["flaky"]')

    assert code == 2
    assert first_forge_line(err) == (
        "forge: error: metrics backend 'flaky' from plugin 'flaky' (forge-flaky 1.0) could not be built: "
        "ValueError: no such project. Check its options; if they are right, this is a bug in forge-flaky: report "
        "it to its authors."
    )
    assert not run_dir.exists()


# -- plugins the run goes without -----------------------------------------------------------------


def test_an_incompatible_plugin_is_named_with_its_reason_at_the_start_of_a_run(forge, run_dir):
    class Old(Faults):
        FORGE_LM_PLUGIN_API = ">=2"

    old = Old("step_end")

    code, err = forge(faulty_manager(("faults", old)))

    assert code == 0, err
    reason = faulty_manager(("faults", Old())).plugin("faults").reason
    assert first_forge_line(err) == f"forge: warning: {LABEL} is incompatible and not used by this run: {reason}"
    assert old.calls == []
