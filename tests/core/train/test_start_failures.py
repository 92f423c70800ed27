"""A start that fails leaves nothing behind; a run directory without a checkpoint takes a new config.

Failures at the first batch (token ids the model cannot embed, ids that are not integers),
preemption signals during start-up, and the run directory's lock, through ``train()`` in
this process. The same through the ``forge`` command: ``tests/hostile/test_run_dirs.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from forge_lm import hookimpl
from forge_lm.data.loader import check_token_ids
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.run_lock import LOCK_FILE, RunDirLocked, RunLock
from forge_lm.train import train
from forge_lm.train.resilience import PreemptedAtStartup, StartupSignals, check_startup
from forge_lm.train.run_dir import RunDirectory


class _Scripted:
    """Random in-vocabulary samples, each passed through ``spoil(index, sample)``."""

    def __init__(self, context, spoil):
        self.context, self.spoil, self.index = context, spoil, 0

    def __iter__(self):
        while True:
            index, self.index = self.index, self.index + 1
            generator = torch.Generator().manual_seed(index)
            tokens = torch.randint(0, self.context.vocab_size, (self.context.seq_len + 1,), generator=generator)
            yield self.spoil(index, {"input_ids": tokens[:-1], "labels": tokens[1:]})

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, state):
        self.index = state["index"]


class _DataPlugin:
    """Registers the dataset ``scripted``; ``on_build`` runs while it is built."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self, spoil=lambda index, sample: sample, on_build=lambda: None):
        self.spoil, self.on_build = spoil, on_build

    @hookimpl
    def forge_lm_register_datasets(self, register):
        def build(options, context):
            self.on_build()
            return _Scripted(context, self.spoil)

        register("scripted", build, description="test data")


def _out_of_vocab_from(first_bad: int):
    def spoil(index, sample):
        if index >= first_bad:
            sample["input_ids"][3] = 300  # the byte tokenizer's vocabulary is 257
        return sample

    return spoil


def _config(tiny_config, run_dir: Path, *overrides: str):
    return tiny_config("--data.name=scripted", "--eval.interval=0", f"--train.output_dir={run_dir}", *overrides)


def test_ids_outside_the_vocabulary_in_the_first_batch_stop_the_run_and_leave_nothing(tiny_config, manager, tmp_path):
    manager.add_plugin(_DataPlugin(spoil=_out_of_vocab_from(0)), "data")
    config = _config(tiny_config, tmp_path / "new" / "nested" / "run")
    with pytest.raises(ForgeError) as caught:
        train(config, manager)
    assert str(caught.value) == (
        "the 'scripted' data (batch 1) holds input_ids outside the model's vocabulary of 257 ids (0 to 256): 300. "
        "The data was made with another tokenizer: set [tokenizer] to the one it was prepared with (or a larger "
        "[model] vocab_size), or prepare the data again with this tokenizer."
    )
    assert not (tmp_path / "new").exists()  # the directories this start created are gone, parents too


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"input_ids": torch.tensor([[0, 256]]), "labels": torch.tensor([[-100, 256]])}, None),
        ({"input_ids": torch.tensor([[-100, 1]])}, "holds input_ids outside the model's vocabulary of 257 ids"),
        ({"labels": torch.tensor([[5, 257, 9000, 257]])}, "(0 to 256): 257, 9000. The data"),
        ({"input_ids": torch.tensor([[0.0, 1.0]])}, "holds input_ids of type torch.float32; token ids must be"),
        ({"labels": torch.tensor([[True]])}, "holds labels of type torch.bool"),
    ],
)
def test_token_ids_are_checked_against_the_vocabulary(batch, message):
    if message is None:
        check_token_ids(batch, 257, "the data")
        return
    with pytest.raises(ForgeError) as caught:
        check_token_ids(batch, 257, "the data")
    assert message in str(caught.value)


def test_a_failure_after_the_first_step_keeps_the_directory_and_a_new_config_may_restart_it(
    tiny_config, manager, tmp_path, capsys
):
    manager.add_plugin(_DataPlugin(spoil=_out_of_vocab_from(4)), "data")  # batch 2 of 4 samples each
    run_dir = tmp_path / "run"
    with pytest.raises(ForgeError, match=r"\(batch 2\) holds input_ids outside"):
        train(_config(tiny_config, run_dir), manager)
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1]  # step 1 happened: kept
    assert not (run_dir / "checkpoints").exists()
    assert not (run_dir / LOCK_FILE).exists()

    corrected = _config(tiny_config, run_dir, "--data.name=synthetic", "--model.dim=64", "--train.max_steps=2")
    capsys.readouterr()
    assert train(corrected, manager).steps == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"forge: warning: '{run_dir}' holds no checkpoint yet, so this run starts it afresh and replaces its "
        "config.toml and plugins.json (changed settings: data.name, model.dim, train.max_steps)\n"
    )
    assert tomllib.loads((run_dir / "config.toml").read_text())["model"]["dim"] == 64


def test_a_directory_that_existed_is_kept_without_a_checkpoint_and_accepts_a_corrected_config(
    tiny_config, manager, tmp_path
):
    manager.add_plugin(_DataPlugin(spoil=_out_of_vocab_from(0)), "data")
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    with pytest.raises(ForgeError, match="outside the model's vocabulary"):
        train(_config(tiny_config, run_dir), manager)
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "config.toml",
        "events.jsonl",
        "metrics.jsonl",
        "plugins.json",
        "run_id",
    ]
    result = train(_config(tiny_config, run_dir, "--data.name=synthetic", "--model.vocab_size=512"), manager)
    assert result.steps == 6
    assert tomllib.loads((run_dir / "config.toml").read_text())["model"]["vocab_size"] == 512


def test_a_run_directory_with_a_checkpoint_still_refuses_a_new_model(tiny_config, manager, tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_config("--train.max_steps=2", f"--train.output_dir={run_dir}"), manager)
    with pytest.raises(ConfigError, match=r"holds a run with other settings for model\.dim"):
        train(tiny_config("--train.max_steps=2", f"--train.output_dir={run_dir}", "--model.dim=64"), manager)


def test_the_run_directory_is_removed_only_when_this_start_created_it_and_trained_nothing(
    tiny_config, manager, tmp_path
):
    config = tiny_config(f"--train.output_dir={tmp_path / 'a' / 'b'}")
    made = RunDirectory(config.train.output_dir)
    made.open(config, manager)
    assert (tmp_path / "a" / "b" / LOCK_FILE).exists()
    made.close(failed=True)
    assert tmp_path.exists()
    assert not (tmp_path / "a").exists()

    for trained, failed in ((True, True), (False, False)):
        kept = RunDirectory(config.train.output_dir)
        kept.open(config, manager)
        kept.trained = trained
        kept.close(failed=failed)
        assert (tmp_path / "a" / "b" / "config.toml").exists()
        assert not (tmp_path / "a" / "b" / LOCK_FILE).exists()
        kept.close(failed=failed)  # idempotent


def test_a_failed_start_removes_a_parent_it_created_only_if_no_other_run_started_in_it(tiny_config, manager, tmp_path):
    config = tiny_config(f"--train.output_dir={tmp_path / 'runs' / 'mine'}")
    made = RunDirectory(config.train.output_dir)
    made.open(config, manager)  # created runs/ and runs/mine
    (tmp_path / "runs" / "theirs").mkdir()  # another run started beside it meanwhile
    (tmp_path / "runs" / "theirs" / "config.toml").write_text("# theirs\n")
    made.close(failed=True)
    assert not (tmp_path / "runs" / "mine").exists()
    assert (tmp_path / "runs" / "theirs" / "config.toml").read_text() == "# theirs\n"


def test_a_start_that_lost_the_race_for_a_directory_it_made_leaves_it_to_the_winner(
    tiny_config, manager, tmp_path, monkeypatch
):
    def another_run_locked_it_first(lock):
        raise RunDirLocked("in use")

    monkeypatch.setattr(RunLock, "acquire", another_run_locked_it_first)
    config = tiny_config(f"--train.output_dir={tmp_path / 'new'}")
    with pytest.raises(RunDirLocked), RunDirectory(config.train.output_dir) as run:
        run.open(config, manager)
    assert (tmp_path / "new").is_dir()


def test_a_locked_run_directory_is_refused_and_nothing_is_written_into_it(tiny_config, manager, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    held = pytest.raises(RunDirLocked, match=f"is in use by another run: pid {os.getpid()} on host")
    with RunLock(run_dir), held:  # another run (a second open file: flock tells them apart even in one process)
        train(tiny_config(f"--train.output_dir={run_dir}"), manager)
    assert list(run_dir.iterdir()) == []


@pytest.fixture
def noted_signals():
    """A handler of our own under the one being tested, so that a missed signal is seen (and
    never ends the test process)."""
    seen: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: seen.append(signum)) for sig in _SIGNALS}
    yield seen
    for sig, handler in previous.items():
        signal.signal(sig, handler)


_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def test_a_signal_during_start_up_stops_at_the_next_safe_point(noted_signals):
    check_startup()  # nothing installed, nothing received
    with StartupSignals(timeout=600) as startup:
        check_startup()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert startup.received == signal.SIGUSR1
        with pytest.raises(PreemptedAtStartup) as caught:
            check_startup()
    assert caught.value.signal_name == "SIGUSR1"
    assert noted_signals == []
    assert signal.getsignal(signal.SIGTERM) is not startup._handle  # handed back
    check_startup()  # uninstalled: nothing to stop for


def test_a_signal_noted_before_the_watcher_was_installed_is_kept(noted_signals):
    with StartupSignals(timeout=600, earlier=[signal.SIGTERM]) as startup:
        assert startup.received == signal.SIGTERM
        with pytest.raises(PreemptedAtStartup):
            check_startup()


@pytest.mark.parametrize("when", ["building", "train_start"])
def test_a_signal_during_start_up_stops_the_run_before_its_first_step_leaving_nothing(
    tiny_config, manager, tmp_path, noted_signals, when
):
    signal_self = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGTERM)  # noqa: E731

    class Hooks:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl
        def forge_lm_train_start(self, context):
            if when == "train_start":
                assert (context.run_dir / "config.toml").exists()  # prepared by then
                signal_self()

    manager.add_plugin(_DataPlugin(on_build=signal_self if when == "building" else lambda: None), "data")
    manager.add_plugin(Hooks(), "hooks")
    config = _config(tiny_config, tmp_path / "run")
    with StartupSignals(timeout=600), pytest.raises(PreemptedAtStartup) as caught:
        train(config, manager)
    assert caught.value.signal_name == "SIGTERM"
    assert noted_signals == []
    assert not (tmp_path / "run").exists()


def test_a_start_up_that_reaches_no_safe_point_exits_75_when_the_signal_timeout_is_up(tmp_path):
    script = (
        "import os, signal, time\n"
        "from forge_lm.train.resilience import StartupSignals\n"
        "with StartupSignals(timeout=0.2):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(60)\n"  # a start-up step that hangs
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 75, done.stderr
    assert done.stderr.startswith(
        "forge: SIGTERM received during start-up, and start-up did not reach a point to stop within 0.2 s; exiting "
        "now. No step was trained: run the same command to start again."
    )


def test_evaluation_batches_are_checked_against_the_vocabulary_like_training_batches():
    from forge_lm.train.evaluate import Evaluator

    class Samples(list):  # a dataset: iterable, with a (trivial) position
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    ids = torch.tensor([1, 2, 300, 4])
    evaluator = Evaluator(Samples([{"input_ids": ids, "labels": ids}] * 4), 2, 1, torch.device("cpu"), None, 257)
    with pytest.raises(ForgeError, match=r"the evaluation data .*300"):
        evaluator.run(lambda batch: 0.0, lambda value: value)
