"""Optimizer contract: ``factory(options, model) -> torch.optim.Optimizer``."""

from __future__ import annotations

import torch

from forge_lm.testing._kit import Subject, category_check
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
