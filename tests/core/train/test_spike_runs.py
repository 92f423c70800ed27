"""``[resilience] spike_policy`` on real runs, with a dataset that injects a spike at a known batch.

The reference for each policy is a run without it on the same data less the batches the policy
says it skips: its losses must equal the policy's run bit for bit. A skipped step leaves the
weights, the optimizer and the schedule as they were, and a rollback restores them exactly, so
any batch trained on that should not have been (or the other way round) shows in the losses.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import attrs
import pytest
import torch

from forge_lm import hookimpl
from forge_lm.config import load_config
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.testing.distributed import torchrun
from forge_lm.train import train
from forge_lm.train.spikes import SpikesPersist

BATCH = 4
PERIOD = 32  # the normal data counts up through this many token ids: quickly learnt


@attrs.define
class SpikyOptions:
    spike_batches: list[int] = attrs.field(factory=list)  # loader batches (1-based) whose labels are noise
    leave_out: list[int] = attrs.field(factory=list)  # batches of the stream never yielded


class _Spiky:
    """Sample ``i`` of the stream belongs to batch ``i // BATCH + 1``; a batch named in
    ``spike_batches`` has random labels (a model that learnt to count is confidently wrong
    there: its loss jumps), a batch in ``leave_out`` is not yielded at all."""

    def __init__(self, options: SpikyOptions, seq_len: int) -> None:
        self.options, self.seq_len, self.next = options, seq_len, 0

    def __iter__(self):
        while True:
            index, self.next = self.next, self.next + 1
            batch = index // BATCH + 1
            if batch in self.options.leave_out:
                continue
            start = index * 7 % PERIOD
            tokens = (torch.arange(self.seq_len + 1) + start) % PERIOD
            labels = tokens[1:]
            if batch in self.options.spike_batches:
                generator = torch.Generator().manual_seed(index)
                labels = torch.randint(PERIOD, 256, (self.seq_len,), generator=generator)
            yield {"input_ids": tokens[:-1], "labels": labels}

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = int(state["next"])


class _SpikyPlugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    @hookimpl
    def forge_lm_register_datasets(self, register):
        register(
            "spiky",
            lambda options, context: _Spiky(options, context.seq_len),
            config=SpikyOptions,
            description="counting sequences, with noise labels in chosen batches",
        )


RUN = (
    *TINY_MODEL,
    "--train.seq_len=16",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--data.name=spiky",
    "--train.max_steps=8",
    f"--train.batch_size={BATCH}",
    "--optimizer.lr=1e-2",
    "--scheduler.name=constant",
    "--scheduler.warmup_steps=1",
    "--eval.interval=0",
    "--resilience.spike_window=3",
    "--resilience.spike_sigmas=3",
    "--resilience.spike_warmup_steps=1",
)
SKIP = ("--resilience.spike_policy=skip", "--data.spike_batches=[6]")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(*overrides)``: the run directory of a finished run (each distinct run trained once
    for the module: several tests compare against the same one)."""
    manager = PluginManager(PluginSettings(autoload=False))
    manager.add_plugin(_SpikyPlugin(), "spiky")
    done: dict[tuple[str, ...], Path] = {}

    def run(*overrides: str, output_dir: Path | None = None) -> Path:
        if output_dir is None and overrides in done:
            return done[overrides]
        run_dir = output_dir or tmp_path_factory.mktemp("spikes") / "run"
        train(load_config(None, [*RUN, *overrides, f"--train.output_dir={run_dir}"], manager.registry), manager)
        done.setdefault(overrides, run_dir)
        return run_dir

    return run


def losses(run_dir: Path) -> dict[int, float]:
    """The loss per step; a step logged twice (redone after a rollback): the later record."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def events(run_dir: Path, kind: str) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [r for r in records if r["type"] == kind]


def test_skip_drops_the_spike_step_and_trains_on_as_if_its_batch_were_not_there(runs):
    skipped = runs(*SKIP)
    reference = runs("--data.leave_out=[6]")  # no policy, and no batch 6
    assert losses(skipped) == losses(reference)  # bit for bit, every step
    (spike,) = events(skipped, "loss_spike")
    assert (spike["at_step"], spike["action"], spike["skipped_batches"], spike["step"]) == (6, "skip", [6, 6], 5)
    window = [losses(skipped)[step] for step in (3, 4, 5)]  # steps 2-5 past the warm-up; the last 3
    mean, std = statistics.fmean(window), statistics.pstdev(window)
    assert spike["mean"] == pytest.approx(mean, rel=1e-12)
    assert spike["std"] == pytest.approx(std, rel=1e-9)
    assert spike["value"] > spike["threshold"] == pytest.approx(mean + 3 * std, rel=1e-9)
    assert [r["spikes"] for r in read_metrics(skipped / "metrics.jsonl") if "loss" in r] == [0] * 5 + [1] * 3


def test_without_the_policy_the_spike_step_is_applied(runs):
    applied, skipped = losses(runs("--data.spike_batches=[6]")), losses(runs(*SKIP))
    assert [applied[step] for step in range(1, 6)] == [skipped[step] for step in range(1, 6)]
    (spike,) = events(runs(*SKIP), "loss_spike")
    assert applied[6] == spike["value"]  # the very step the policy judged, trained on here
    assert applied[6] > applied[5] + 1.0
    assert applied[7] != skipped[7]
    assert not events(runs("--data.spike_batches=[6]"), "loss_spike")


def test_rollback_returns_to_the_checkpoint_and_skips_the_batches_read_since(runs):
    rolled = runs("--resilience.spike_policy=rollback", "--data.spike_batches=[6]", "--checkpoint.interval=4")
    reference = runs("--data.leave_out=[5,6]")  # batches 5 and 6 were read after step 4's checkpoint
    steps = [r["step"] for r in read_metrics(rolled / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 5, 6, 7, 8]  # step 5 trained, then redone from step 4's checkpoint
    assert losses(rolled) == losses(reference)
    (spike,) = events(rolled, "loss_spike")
    assert (spike["at_step"], spike["action"]) == (6, "rollback")
    (rollback,) = events(rolled, "rollback")
    assert (rollback["to_step"], rollback["skipped_batches"]) == (4, [5, 6])


def test_a_resumed_run_judges_with_the_window_it_saved(runs, tmp_path):
    """The window is in the checkpoint: resumed at step 4, the run still holds steps 2-4's losses
    and catches the spike at step 6 exactly as the straight run does. Without the saved window,
    only step 5 would be in it at step 6, too few to judge."""
    run_dir = tmp_path / "run"
    runs(*SKIP, "--train.max_steps=4", output_dir=run_dir)
    runs(*SKIP, output_dir=run_dir)
    assert losses(run_dir) == losses(runs(*SKIP))
    assert [e["at_step"] for e in events(run_dir, "loss_spike")] == [6]


def test_spikes_in_a_row_stop_the_run_with_exit_3(runs):
    with pytest.raises(SpikesPersist, match=r"stopping after 2 spikes in a row \(resilience.max_spike_steps = 2\)"):
        runs("--resilience.spike_policy=skip", "--data.spike_batches=[6,7]", "--resilience.max_spike_steps=2")
    assert SpikesPersist.exit_code == 3


SITE_MODULE = """
from test_spike_runs import _SpikyPlugin

FORGE_LM_PLUGIN_API = ">=1,<2"
forge_lm_register_datasets = _SpikyPlugin().forge_lm_register_datasets
"""


def test_two_ranks_take_the_same_decisions_as_one_process(runs, tmp_path):
    """Under torchrun (2 ranks, gloo, FSDP2) both ranks judge the all-reduced loss against the
    same window: they skip and roll back together (a rank deciding alone would hang the next
    collective), at the step the one-process run did, naming the same batches."""
    (tmp_path / "forge_spiky_site.py").write_text(SITE_MODULE)
    info = tmp_path / "forge_spiky_site-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: forge-spiky-site\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[forge_lm]\nspiky = forge_spiky_site\n")
    path = os.pathsep.join([str(tmp_path), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    policy = ("--resilience.spike_policy=rollback", "--data.spike_batches=[6]", "--checkpoint.interval=4")
    run_dir = tmp_path / "run"
    done = torchrun(
        ["-m", "forge_lm", "train", *RUN, *policy, "--distributed.dp_shard=2", f"--train.output_dir={run_dir}"],
        env={"PYTHONPATH": path},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    alone = runs(*policy)
    for kind in ("loss_spike", "rollback"):
        drop = ("time", "value", "mean", "std", "threshold", "rank")  # the values: FSDP2's sums, not bitwise
        assert [{k: v for k, v in e.items() if k not in drop} for e in events(run_dir, kind)] == [
            {k: v for k, v in e.items() if k not in drop} for e in events(alone, kind)
        ]
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 5, 6, 7, 8]
