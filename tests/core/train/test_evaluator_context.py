"""``EvaluatorContext`` gives an evaluator the run's evaluation data, its autocast context and
the way the run calls the model: an evaluator that recomputes the validation loss from them
alone (no config.toml read) gets the run's own ``eval/loss``."""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F

from forge_lm import hookimpl
from forge_lm.config import LlamaOptions
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.model import build_model
from forge_lm.testing import check_component
from forge_lm.train import train


class _RecomputedLoss:
    """The mean cross-entropy over every evaluation set the context gives, logged beside the
    run's own as ``mine/<prefix>``."""

    def __init__(self, context):
        self.context = context
        self.sets = {context.validation.prefix: context.validation} if context.validation is not None else {}
        self.sets |= {data.prefix: data for data in context.eval_sets.values()}

    def evaluate(self, model, step):
        results = {}
        for prefix, data in self.sets.items():
            losses = []
            for batch in data.batches():
                with self.context.autocast():
                    logits = self.context.call_model(model, batch)
                losses.append(F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten()).item())
            assert len(losses) == data.steps
            results[f"mine/{prefix}/loss"] = sum(losses) / len(losses)
        return results


class _Plugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self):
        self.contexts = []

    @hookimpl
    def forge_lm_register_evaluators(self, register):
        def build(options, context):
            self.contexts.append(context)
            return _RecomputedLoss(context)

        register("recomputed", build, config=attrs.make_class("NoOptions", []), description="the eval loss again")


@pytest.fixture
def recomputed(manager):
    plugin = _Plugin()
    manager.add_plugin(plugin, "recomputed")
    return plugin


def _evaluations(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if any(key.startswith("mine/") for key in r)]


def test_an_evaluator_recomputes_the_runs_validation_loss_from_the_context(tiny_config, manager, recomputed):
    result = train(tiny_config('--eval.evaluators=["recomputed"]'), manager)

    (context,) = recomputed.contexts
    assert context.eval_sets == {}
    assert (context.validation.prefix, context.validation.steps) == ("eval", 2)
    evaluations = _evaluations(result.run_dir)
    assert [r["step"] for r in evaluations] == [3, 6]
    for record in evaluations:
        assert record["mine/eval/loss"] == pytest.approx(record["eval/loss"], rel=1e-6, abs=0)
    assert evaluations[0]["eval/loss"] != evaluations[1]["eval/loss"]  # the live model at each evaluation


def test_named_sets_and_the_runs_autocast_reach_the_evaluator(tiny_config, manager, recomputed):
    config = tiny_config(
        '--eval.evaluators=["recomputed"]',
        "--eval.datasets.synth.name=synthetic",
        "--eval.datasets.synth.steps=3",
        "--eval.datasets.heldout.steps=1",
        "--train.precision=bf16",
        "--train.max_steps=3",
    )
    result = train(config, manager)

    (context,) = recomputed.contexts
    assert context.validation is None  # the named sets replace [data]'s held-out split
    assert {name: (data.prefix, data.steps) for name, data in context.eval_sets.items()} == {
        "synth": ("eval/synth", 3),
        "heldout": ("eval/heldout", 1),
    }
    with context.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.is_autocast_enabled("cpu")
    (record,) = _evaluations(result.run_dir)
    for name in ("synth", "heldout"):
        # Under bf16 autocast: equal to the run's only with the run's autocast context.
        assert record[f"mine/eval/{name}/loss"] == pytest.approx(record[f"eval/{name}/loss"], rel=1e-6, abs=0)


def _by_hand(model, data) -> float:
    """The mean over the set's batches of the next-token cross-entropy, in float64 from log_softmax."""
    losses = []
    for batch in data.batches():
        log_probs = torch.log_softmax(model(batch["input_ids"]).double(), dim=-1)
        losses.append(-log_probs.gather(-1, batch["labels"].unsqueeze(-1)).mean().item())
    return sum(losses) / len(losses)


def test_the_kit_gives_an_evaluator_evaluation_data_as_a_run_does(manager, recomputed):
    """The kit's context holds validation data and a named set, the same batches every call, so
    an evaluator that reads them passes the kit; what it computes from them is the cross-entropy."""
    check_component("evaluators", "recomputed", manager=manager)

    context = recomputed.contexts[-1]
    model = build_model(LlamaOptions(dim=32, n_layers=1, n_heads=4), context.vocab_size, manager.registry).eval()
    with torch.no_grad():
        returned = _RecomputedLoss(context).evaluate(model, 1)
        expected = {
            "mine/eval/loss": _by_hand(model, context.validation),
            "mine/eval/kit/loss": _by_hand(model, context.eval_sets["kit"]),
        }
    assert returned == pytest.approx(expected, rel=1e-5)
    assert expected["mine/eval/loss"] != expected["mine/eval/kit/loss"]  # two different sets
