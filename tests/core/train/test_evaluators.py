"""``[eval] evaluators``: a plugin's evaluator runs on the live model at each evaluation."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
import torch.nn.functional as F

from forge_lm import hookimpl
from forge_lm.errors import ConfigError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.train import train
from forge_lm.train.inference import load_for_inference
from forge_lm.train.preflight import validation_report

PROBE = "def probe(x):\n    return x + 1\n"


@attrs.define
class ProbeOptions:
    text: str = PROBE
    junk: bool = False  # return values that are not metrics too


class _Probe:
    """The model's mean cross-entropy on a fixed text, through the run's tokenizer."""

    def __init__(self, options, context, seen):
        self.options, self.context, self.seen = options, context, seen

    def evaluate(self, model, step):
        self.seen.append((step, model.training, torch.is_grad_enabled()))
        ids = torch.tensor([self.context.tokenizer.encode(self.options.text)], device=self.context.device)
        metrics = {"eval/probe/loss": probe_loss(model, ids)}
        if self.options.junk:
            metrics |= {"eval/probe/name": "text", "eval/loss": 0.0, 3: 1.0}
        return metrics


def probe_loss(model, ids) -> float:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten()).item()


class _ProbePlugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self):
        self.seen, self.contexts = [], []

    @hookimpl
    def forge_lm_register_evaluators(self, register):
        def build(options, context):
            self.contexts.append(context)
            return _Probe(options, context, self.seen)

        register("probe", build, config=ProbeOptions, description="loss on a fixed text")


@pytest.fixture
def probe(manager):
    plugin = _ProbePlugin()
    manager.add_plugin(plugin, "probe")
    return plugin


def test_an_evaluator_runs_at_each_evaluation_on_the_live_model_and_is_logged(tiny_config, manager, probe):
    config = tiny_config('--eval.evaluators=["probe"]', "--data.name=python_stdlib")
    result = train(config, manager)
    assert probe.seen == [(3, False, False), (6, False, False)]  # eval mode, no gradients
    (context,) = probe.contexts
    assert (context.vocab_size, context.seq_len, context.max_seq_len, context.rank) == (257, 16, 64, 0)
    evals = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "eval/loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(math.isfinite(r["eval/probe/loss"]) for r in evals)
    # The value at the last step is the final model's: recomputed independently from its checkpoint.
    model, _, tokenizer = load_for_inference(result.run_dir, manager)
    with torch.no_grad():
        expected = probe_loss(model, torch.tensor([tokenizer.encode(PROBE)]))
    assert evals[-1]["eval/probe/loss"] == pytest.approx(expected, rel=1e-6)


def test_what_an_evaluator_returns_that_is_not_a_metric_is_left_out_with_one_warning(
    tiny_config, manager, probe, capsys
):
    result = train(tiny_config('--eval.evaluators=["probe"]', "--eval.probe.junk=true"), manager)
    evals = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "eval/loss" in r]
    assert all(set(r) == {"step", "eval/loss", "eval/perplexity", "eval/probe/loss"} for r in evals)
    assert all(r["eval/loss"] != 0.0 for r in evals)  # the held-out loss was not replaced
    err = capsys.readouterr().err
    assert err.count("evaluator 'probe' (") == 1
    assert "returned unusable metrics" in err


def test_an_unknown_evaluator_is_a_config_error_naming_the_category(tiny_config):
    with pytest.raises(ConfigError, match="unknown evaluator 'no_such_benchmark'"):
        tiny_config('--eval.evaluators=["no_such_benchmark"]')


def test_evaluators_do_not_run_when_evaluation_is_off(tiny_config, manager, probe):
    train(tiny_config('--eval.evaluators=["probe"]', "--eval.interval=0"), manager)
    assert probe.seen == []
    assert probe.contexts == []


@pytest.mark.parametrize(
    ("layout", "refused"),
    [
        (("--distributed.pp=2", "--model.tie_embeddings=false", "--train.grad_accum_steps=2"), "pp = 2"),
        (("--distributed.cp=2",), "cp = 2"),
    ],
    ids=["pipeline", "context"],
)
def test_validation_refuses_evaluators_under_pipeline_or_context_parallelism(
    tiny_config, manager, probe, layout, refused
):
    # forge config validate's check, before any process starts or anything is built.
    with pytest.raises(ConfigError, match=rf"\[distributed\] {refused} cannot run \[eval\] evaluators.*train with"):
        validation_report(tiny_config('--eval.evaluators=["probe"]', *layout), manager.registry)
    validation_report(tiny_config(*layout), manager.registry)  # the layout alone is valid
    validation_report(tiny_config('--eval.evaluators=["probe"]', "--eval.interval=0", *layout), manager.registry)
    assert probe.contexts == []
