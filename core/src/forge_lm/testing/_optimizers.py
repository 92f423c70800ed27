"""Optimizer contract: ``factory(options, model) -> torch.optim.Optimizer``, with the declarations
of :mod:`forge_lm.components` checked where made: ``FORGE_LM_OPTIMIZER_STATES`` on the options
class (:class:`~forge_lm.components.DeclaresOptimizerStates`) and ``evolving_group_keys`` on the
optimizer (:class:`~forge_lm.components.EvolvingGroupKeys`)."""

from __future__ import annotations

import torch

from forge_lm.components import DeclaresOptimizerStates, EvolvingGroupKeys
from forge_lm.testing._kit import Subject, category_check, skip_check
from forge_lm.testing._tiny import plain_round_trip, tiny_batch, tiny_loss, tiny_model

STEPS = 40
REQUIRED_DROP = 0.2  # the loss must fall by at least this fraction of its first value within STEPS
CHECK_LR = 1e-2  # large enough for the tiny problem to move within STEPS


def _build(subject: Subject, model: torch.nn.Module) -> torch.optim.Optimizer:
    overrides = {"lr": CHECK_LR} if subject.has_option("lr") and "lr" not in subject.options_table else {}
    optimizer = subject.build(model, options=subject.options(**overrides))
    assert isinstance(optimizer, torch.optim.Optimizer), (
        f"{subject.label} returned {type(optimizer).__name__}; the kit expects a torch.optim.Optimizer"
    )
    return optimizer


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    batch = tiny_batch()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = tiny_loss(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@category_check("optimizers")
def check_covers_every_trainable_parameter_once(subject: Subject) -> None:
    model = tiny_model()
    optimizer = _build(subject, model)
    seen = [id(p) for group in optimizer.param_groups for p in group["params"]]
    expected = {id(p) for p in model.parameters() if p.requires_grad}
    names = {id(p): name for name, p in model.named_parameters()}
    repeated = sorted({names.get(i, "?") for i in seen if seen.count(i) > 1})
    assert not repeated, (
        f"{subject.label} puts parameters in more than one group: {repeated}; the kit expects each of the "
        f"{len(expected)} trainable parameters in exactly one group"
    )
    missing = [name for name, p in model.named_parameters() if id(p) not in set(seen)]
    assert not missing and set(seen) == expected, (
        f"{subject.label} leaves parameters out: {missing}; the kit expects all {len(expected)} trainable "
        f"parameters in its groups, found {len(set(seen) & expected)}"
    )


@category_check("optimizers")
def check_lowers_the_loss_of_a_tiny_problem(subject: Subject) -> None:
    model = tiny_model()
    losses = _train(model, _build(subject, model), STEPS)
    bad = [step for step, loss in enumerate(losses) if not torch.isfinite(torch.tensor(loss))]
    assert not bad, (
        f"{subject.label} produced a non-finite loss at steps {bad[:5]} of {STEPS}; the kit expects every loss "
        f"finite: {losses}"
    )
    fell = 1 - losses[-1] / losses[0]
    assert fell >= REQUIRED_DROP, (
        f"{subject.label} did not lower the loss of the tiny problem: it went from {losses[0]:.4f} to "
        f"{losses[-1]:.4f} in {STEPS} steps (a fall of {fell:.1%}); the kit expects it to fall by at least "
        f"{REQUIRED_DROP:.0%}"
    )


@category_check("optimizers")
def check_state_dict_round_trip_resumes_exactly(subject: Subject) -> None:
    model = tiny_model()
    optimizer = _build(subject, model)
    _train(model, optimizer, 5)
    saved_model = plain_round_trip(model.state_dict())
    saved_optimizer = plain_round_trip(optimizer.state_dict())
    _train(model, optimizer, 5)

    resumed = tiny_model(seed=123)  # different initial weights: everything must come from the state
    resumed.load_state_dict(saved_model)
    resumed_optimizer = _build(subject, resumed)
    resumed_optimizer.load_state_dict(saved_optimizer)
    _train(resumed, resumed_optimizer, 5)
    for (name, expected), actual in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(expected, actual), (
            f"{subject.label}: after a state_dict round trip, parameter '{name}' differs from the uninterrupted run "
            f"by up to {(expected.double() - actual.double()).abs().max().item():.3g} after 5 more steps; the kit "
            "expects it bit for bit equal"
        )


@category_check("optimizers")
def check_declared_state_count_bounds_the_state_it_keeps(subject: Subject) -> None:
    """After a few steps, no parameter has more state tensors of its own size than the options
    class declares (the memory estimate counts them)."""
    options_class = subject.component.options_class
    if not isinstance(options_class, DeclaresOptimizerStates):
        skip_check(f"{subject.label}'s options class declares no FORGE_LM_OPTIMIZER_STATES")
    declared = options_class.FORGE_LM_OPTIMIZER_STATES
    assert isinstance(declared, int | float) and not isinstance(declared, bool) and 0 <= declared < float("inf"), (
        f"{subject.label}: FORGE_LM_OPTIMIZER_STATES is {declared!r}; the kit expects a number >= 0 (state tensors "
        "per parameter)"
    )
    model = tiny_model()
    optimizer = _build(subject, model)
    _train(model, optimizer, 3)
    names = {id(p): name for name, p in model.named_parameters()}
    counts = {
        names.get(id(param), "?"): sum(
            isinstance(value, torch.Tensor) and value.shape == param.shape for value in state.values()
        )
        for param, state in optimizer.state.items()
    }
    over = {name: count for name, count in counts.items() if count > declared}
    assert not over, (
        f"{subject.label} keeps {max(over.values())} state tensors the size of '{max(over, key=over.get)}' after 3 "
        f"steps; its options class declares FORGE_LM_OPTIMIZER_STATES = {declared}, and the kit expects no "
        "parameter to have more"
    )


@category_check("optimizers")
def check_evolving_group_keys_are_in_every_group(subject: Subject) -> None:
    """``evolving_group_keys``: a tuple of key names present in every parameter group (a resumed
    run restores them from the checkpoint)."""
    model = tiny_model()
    optimizer = _build(subject, model)
    if not isinstance(optimizer, EvolvingGroupKeys):
        skip_check(f"{subject.label} declares no evolving_group_keys")
    keys = optimizer.evolving_group_keys
    assert isinstance(keys, tuple) and all(isinstance(key, str) and key for key in keys), (
        f"{subject.label}: evolving_group_keys is {keys!r}; the kit expects a tuple of parameter-group key names"
    )
    _train(model, optimizer, 2)
    missing = sorted({key for group in optimizer.param_groups for key in keys if key not in group})
    assert not missing, (
        f"{subject.label}: evolving_group_keys names {missing}, which some parameter group lacks after 2 steps; the "
        "kit expects every named key in every group"
    )
