"""A run that meets NaN writes a metrics.jsonl that strict JSON parsers read, and the readers
give the NaN back."""

from __future__ import annotations

import json
import math

import attrs
import pytest
import torch.nn.functional as F

from forge_lm import hookimpl
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.testing.distributed import metrics_by_step
from forge_lm.train import train


@attrs.define
class NanAtOptions:
    calls: list[int] = attrs.Factory(list)


class _NanAt:
    """Cross-entropy, times NaN on the listed calls (training steps and evaluation batches alike)."""

    def __init__(self, calls: list[int]) -> None:
        self.calls, self.count = set(calls), 0

    def __call__(self, logits, labels):
        self.count += 1
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return loss * float("nan") if self.count in self.calls else loss


class _NanPlugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    @hookimpl
    def forge_lm_register_losses(self, register):
        register("nan_at", lambda options: _NanAt(options.calls), config=NanAtOptions, description="NaN at calls")


def _refuse(constant: str) -> None:
    raise ValueError(f"not strict JSON: {constant}")


@pytest.fixture
def nan_run(tiny_config, manager):
    """Six steps, an evaluation (two batches) at steps 3 and 6: the loss's second call (step 2's
    first try, skipped by nan_policy = skip) and fifth (the first batch of the step-3 evaluation)
    are NaN, so the step-3 record holds eval/loss = NaN."""
    manager.add_plugin(_NanPlugin(), "nan")
    config = tiny_config("--loss.name=nan_at", "--loss.calls=[2, 5]", "--resilience.nan_policy=skip")
    return train(config, manager).run_dir


def test_a_run_meeting_nan_writes_strict_json_and_readers_give_nan_back(nan_run):
    lines = (nan_run / "metrics.jsonl").read_text().splitlines()
    strict = [json.loads(line, parse_constant=_refuse) for line in lines]  # no bare NaN/Infinity anywhere
    (written,) = [r for r in strict if r["step"] == 3 and "eval/loss" in r]
    assert written["eval/loss"] is None
    assert written["eval/perplexity"] is None
    assert written["nonfinite"] == {"eval/loss": "nan", "eval/perplexity": "nan"}

    records = read_metrics(nan_run / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]  # the NaN step was skipped
    (evaluated,) = [r for r in records if r["step"] == 3 and "eval/loss" in r]
    assert math.isnan(evaluated["eval/loss"])
    assert math.isnan(evaluated["eval/perplexity"])
    assert "nonfinite" not in evaluated  # the spelling map is the file's, not a metric
    (later,) = [r for r in records if r["step"] == 6 and "eval/loss" in r]
    assert math.isfinite(later["eval/loss"])
    assert math.isnan(metrics_by_step(nan_run)[3]["eval/loss"])  # the testing helpers' reader
