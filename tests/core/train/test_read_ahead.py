"""The training loop with its loader reading ahead into pinned memory (what it does on CUDA),
forced on here on CPU, against the same runs reading in the training thread: the same losses
bit for bit, through a resume and a rollback, and no reader thread outlives the run."""

from __future__ import annotations

import threading

import attrs
import pytest
import torch

from forge_lm import hookimpl
from forge_lm.config import load_config
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.train import Run, parts, train


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def reader_threads():
    return [thread for thread in threading.enumerate() if thread.name == "forge-batch-reader"]


@pytest.fixture
def read_ahead(monkeypatch):
    """``read_ahead()`` turns the CUDA behaviour on for the runs that follow; returns the list
    of tensors pinned (Tensor.pin_memory, which needs CUDA, is replaced by a recorder)."""
    pinned = []

    def pin_memory(self, *args, **kwargs):
        pinned.append(threading.current_thread().name)
        return self.clone()

    def turn_on():
        monkeypatch.setattr(parts, "batch_transfer", lambda device: {"read_ahead": True, "pin_memory": True})
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        return pinned

    return turn_on


def test_a_run_reading_ahead_logs_the_same_losses_and_resumes_bit_for_bit(tiny_config, manager, read_ahead):
    constant = "--scheduler.name=constant"  # the schedule does not depend on max_steps
    straight = train(tiny_config(constant, "--train.max_steps=6"), manager)  # reads in the training thread
    pinned = read_ahead()
    first = train(tiny_config(constant, "--train.max_steps=3"), manager)
    assert not reader_threads()
    resumed = train(load_config(first.run_dir / "config.toml", ["--train.max_steps=6"], manager.registry), manager)
    assert resumed.steps == 6
    assert not reader_threads()
    assert losses(resumed.run_dir) == losses(straight.run_dir)  # steps 1-3, then 4-6 after resuming
    assert pinned
    assert set(pinned) == {"forge-batch-reader"}


@attrs.define
class NanOnceOptions:
    at_call: int = 1


class _NanOnce:
    """Cross-entropy, but NaN on its ``at_call``-th call: a bad step the loop rolls back."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    @hookimpl
    def forge_lm_register_losses(self, register):
        def build(options):
            calls = []

            def loss(logits, labels):
                calls.append(1)
                value = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                return value * float("nan") if len(calls) == options.at_call else value

            return loss

        register("nan_once", build, config=NanOnceOptions, description="NaN once")


def test_a_rollback_while_reading_ahead_goes_on_past_the_bad_batch_as_without(tiny_config, manager, read_ahead):
    """The rollback loads the data position into the loader while its reader has read the next
    batch: that batch is dropped and read again from the loaded position."""
    manager.add_plugin(_NanOnce(), "nan_once")
    options = (
        "--train.max_steps=6",
        "--checkpoint.interval=2",
        "--resilience.nan_policy=rollback",
        "--loss.name=nan_once",
        "--loss.at_call=4",  # step 4's batch, after the checkpoint of step 2
        "--eval.interval=0",
    )
    plain = train(tiny_config(*options), manager)
    read_ahead()
    reading = train(tiny_config(*options), manager)
    assert not reader_threads()
    assert [step for step, _ in losses(plain.run_dir)] == [1, 2, 3, 3, 4, 5, 6]  # step 3 again after the rollback
    assert losses(reading.run_dir) == losses(plain.run_dir)


def test_the_reader_thread_ends_when_the_run_fails(tiny_config, manager, read_ahead, monkeypatch):
    read_ahead()

    def failing_log(run, step, metrics):
        if step == 2:
            raise RuntimeError("a metrics sink broke")

    monkeypatch.setattr(Run, "log", failing_log)
    with pytest.raises(RuntimeError, match="a metrics sink broke"):
        train(tiny_config("--train.max_steps=4", "--eval.interval=0"), manager)
    assert not reader_threads()
