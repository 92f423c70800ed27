"""The kit checks what a component declares through the protocols of forge_lm.components: a
declaration that does not hold fails the check that names it; one that holds passes; a component
without the declaration skips the check (with the reason)."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest
import torch

from forge_lm import hookimpl
from forge_lm.components import (
    DeclaresOptimizerStates,
    EvolvingGroupKeys,
    LearningRateOptions,
    ReportsResults,
)
from forge_lm.config import LlamaOptions
from forge_lm.model import Transformer
from forge_lm.model.transformer import attention_spec, build_layers
from forge_lm.testing import component_checks

TINY = {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32}


@attrs.define
class OneStateOptions(LearningRateOptions):
    FORGE_LM_OPTIMIZER_STATES: ClassVar[float] = 1  # AdamW keeps 2: a false declaration


@attrs.define
class TwoStatesOptions(LearningRateOptions):
    FORGE_LM_OPTIMIZER_STATES: ClassVar[float] = 2


class CountingAdamW(torch.optim.AdamW):
    evolving_group_keys = ("updates",)

    def __init__(self, params: Any, lr: float, *, add_key: bool) -> None:
        super().__init__(params, lr=lr)
        if add_key:
            for group in self.param_groups:
                group["updates"] = 0


class ReportingEvaluator:
    def __init__(self, results: Any) -> None:
        self.results, self.table, self._returned = None, "", results

    def evaluate(self, model: Any, step: int) -> dict[str, float]:
        self.results, self.table = self._returned, "| task | accuracy |"
        return {"eval/task/accuracy": 0.5}


class MisstatedVocabulary(Transformer):
    @property
    def vocab_size(self) -> int:
        return self._vocab + 1

    @vocab_size.setter
    def vocab_size(self, value: int) -> None:
        self._vocab = value


def _llama(cls: type[Transformer]):
    def factory(options: LlamaOptions, context: Any) -> Transformer:
        ffns = build_layers(options.ffn, context.registry, "feed_forwards", options.dim, options.n_layers)
        attentions = build_layers(options.attention, context.registry, "attentions", attention_spec(options), 1)
        return cls(options, context.vocab_size, ffns, attentions)

    return factory


class Declaring:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    @hookimpl
    def forge_lm_register_optimizers(self, register):
        adamw = lambda options, model: torch.optim.AdamW(model.parameters(), lr=options.lr)  # noqa: E731
        register("overclaims", adamw, config=OneStateOptions, description="declares on purpose")
        register("honest", adamw, config=TwoStatesOptions, description="declares on purpose")
        register(
            "keyed",
            lambda options, model: CountingAdamW(model.parameters(), options.lr, add_key=True),
            config=TwoStatesOptions,
            description="declares on purpose",
        )
        register(
            "unkeyed",
            lambda options, model: CountingAdamW(model.parameters(), options.lr, add_key=False),
            config=LearningRateOptions,
            description="declares on purpose",
        )

    @hookimpl
    def forge_lm_register_evaluators(self, register):
        register(
            "plain_results",
            lambda options, context: ReportingEvaluator({"task": {"accuracy": 0.5}}),
            description="declares on purpose",
        )
        register(
            "object_results",
            lambda options, context: ReportingEvaluator({"task": object()}),
            description="declares on purpose",
        )

    @hookimpl
    def forge_lm_register_models(self, register):
        register("misstated", _llama(MisstatedVocabulary), config=LlamaOptions, description="declares on purpose")
        register("stated", _llama(Transformer), config=LlamaOptions, description="declares on purpose")


@pytest.fixture(scope="module")
def declaring():
    from forge_lm.plugins import PluginManager

    manager = PluginManager()
    info = manager.add_plugin(Declaring(), "declaring", distribution="forge-declaring", version="9.9")
    assert info.status == "ok", info.reason
    return manager


def _check(manager, category: str, name: str, suffix: str, **kwargs: Any):
    checks = {c.id.rsplit(":", 1)[1]: c for c in component_checks(category, name, manager=manager, **kwargs)}
    return checks[suffix]


def test_the_protocols_are_what_the_test_components_declare():
    assert isinstance(OneStateOptions, DeclaresOptimizerStates)
    assert not isinstance(LearningRateOptions, DeclaresOptimizerStates)
    assert isinstance(CountingAdamW([torch.zeros(1, requires_grad=True)], 0.1, add_key=True), EvolvingGroupKeys)
    assert isinstance(ReportingEvaluator({}), ReportsResults)


def test_an_optimizer_keeping_more_states_than_it_declares_fails(declaring):
    with pytest.raises(AssertionError) as caught:
        _check(declaring, "optimizers", "overclaims", "declared_state_count_bounds_the_state_it_keeps")()
    assert "optimizer 'overclaims' keeps 2 state tensors the size of" in str(caught.value)
    assert "declares FORGE_LM_OPTIMIZER_STATES = 1" in str(caught.value)
    _check(declaring, "optimizers", "honest", "declared_state_count_bounds_the_state_it_keeps")()


def test_an_optimizer_declaring_no_state_count_skips_the_check(declaring):
    with pytest.raises(pytest.skip.Exception, match="declares no FORGE_LM_OPTIMIZER_STATES"):
        _check(declaring, "optimizers", "unkeyed", "declared_state_count_bounds_the_state_it_keeps")()


def test_evolving_group_keys_must_be_in_every_group(declaring):
    _check(declaring, "optimizers", "keyed", "evolving_group_keys_are_in_every_group")()
    with pytest.raises(AssertionError, match=r"evolving_group_keys names \['updates'\], which some parameter group"):
        _check(declaring, "optimizers", "unkeyed", "evolving_group_keys_are_in_every_group")()


def test_an_evaluators_results_must_be_plain_data(declaring):
    _check(declaring, "evaluators", "plain_results", "reported_results_are_plain_data")()
    with pytest.raises(AssertionError, match="results cannot be written as JSON"):
        _check(declaring, "evaluators", "object_results", "reported_results_are_plain_data")()


def test_a_models_vocab_size_must_be_its_logits_width(declaring):
    _check(declaring, "models", "stated", "generation_limits_are_the_models", options=TINY)()
    with pytest.raises(AssertionError, match=r"model.vocab_size is 62 but its logits have 61 columns"):
        _check(declaring, "models", "misstated", "generation_limits_are_the_models", options=TINY)()
