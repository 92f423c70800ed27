"""A built component is checked against its category's basic contract where it is built
(forge_lm.plugins._contracts): a factory returning the wrong object is a PluginError naming the
component, its plugin and distribution, not a failure later somewhere else."""

from __future__ import annotations

import dataclasses

import attrs
import pytest
import torch

from forge_lm.errors import PluginError
from forge_lm.plugins._contracts import contract_problem
from forge_lm.plugins._model import Component, PluginInfo


class Scheduler:
    def step(self): ...
    def state_dict(self): ...
    def load_state_dict(self, state): ...


class Dataset:
    def __iter__(self):
        return iter(())

    def state_dict(self): ...
    def load_state_dict(self, state): ...


class Evaluator:
    def evaluate(self, model, step): ...


def test_what_each_category_needs():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert contract_problem("optimizers", optimizer) is None
    assert contract_problem("optimizers", None) == "None, not a torch.optim.Optimizer"
    assert contract_problem("losses", lambda logits, labels: None) is None
    assert contract_problem("losses", 1.0).startswith("a float, not a callable loss_fn")
    assert contract_problem("schedulers", Scheduler()) is None
    assert contract_problem("schedulers", torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)) is None
    assert contract_problem("schedulers", object()).startswith(
        "a object without step(), state_dict(), load_state_dict(); the core needs a scheduler"
    )
    assert contract_problem("datasets", Dataset()) is None
    assert contract_problem("datasets", [1, 2]).startswith("a list without state_dict(), load_state_dict();")
    assert contract_problem("datasets", None).startswith("None; the core needs an iterable of samples")
    assert contract_problem("evaluators", Evaluator()) is None
    assert contract_problem("evaluators", {"evaluate": 1}).startswith("a dict without evaluate()")
    assert contract_problem("feed_forwards", None) is None  # checked where it is used


def test_build_for_run_names_the_component_its_plugin_and_distribution():
    plugin = PluginInfo(name="odd", distribution="forge-odd", version="2.0", module="forge_odd")

    @attrs.define
    class NoOptions:
        pass

    component = Component("optimizers", "mine", lambda options, model: None, NoOptions, "x", plugin)
    with pytest.raises(PluginError) as caught:
        component.build_for_run(NoOptions(), torch.nn.Linear(1, 1))
    assert str(caught.value) == (
        "optimizer 'mine' from plugin 'odd' (forge-odd 2.0) cannot be used: its factory returned None, not a "
        "torch.optim.Optimizer. This is a bug in forge-odd 2.0: report it to its authors, or choose another optimizer."
    )
    evaluator = dataclasses.replace(component, category="evaluators", factory=lambda options, context: Evaluator())
    assert isinstance(evaluator.build_for_run(NoOptions(), None), Evaluator)
    assert component.build(NoOptions(), None) is None  # build itself (the conformance kit's) does not check
