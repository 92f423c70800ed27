"""Scheduler contract: ``factory(options, optimizer, total_steps) -> LRScheduler``.

With a warmup of ``W`` steps the step with index ``s < W`` runs at ``base_lr * (s + 1) / W``.
The warmup is the options' ``warmup_steps`` (:class:`forge_lm.components.WarmupOptions`'s
field), or else their one integer field whose name holds ``warmup`` (``warmup``,
``warmup_iters``, ...): a scheduler is checked whatever it calls it. Every check runs a
scheduler that has one with a warmup: the options table's own value when it sets one above
0, else :data:`WARMUP`; the warmup check is skipped, saying why, for options without one.
"""

from __future__ import annotations

import math

import attrs
import torch

from forge_lm.testing._kit import Subject, category_check, skip_check
from forge_lm.testing._tiny import plain_round_trip

TOTAL, WARMUP = 100, 4
RESUME_AT = 37


def warmup_field(options_class: type) -> str | None:
    """The field of a scheduler's options that holds its warmup (in steps), or None."""
    fields = attrs.fields_dict(options_class)
    if "warmup_steps" in fields:
        return "warmup_steps"
    named = [
        name for name, field in fields.items() if "warmup" in name.lower() and field.type in (int, "int", "int | None")
    ]
    return named[0] if len(named) == 1 else None


def _warmup(subject: Subject) -> tuple[str, int] | None:
    """The warmup field and the warmup the checks run with, or None when the options have none."""
    field = warmup_field(subject.component.options_class)
    if field is None:
        return None
    return field, int(subject.options_table.get(field) or WARMUP)


def _options(subject: Subject) -> object:
    options = subject.options()
    warmup = _warmup(subject)
    return options if warmup is None else attrs.evolve(options, **{warmup[0]: warmup[1]})


def _schedule(subject: Subject, steps: int, state: tuple[object, object] | None = None) -> tuple[list[float], tuple]:
    """Learning rates of ``steps`` consecutive steps (base lr 1.0), and the final state."""
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = subject.build(optimizer, TOTAL, options=_options(subject))
    assert isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler), (
        f"{subject.label} returned {type(scheduler).__name__}; the kit expects a torch.optim.lr_scheduler.LRScheduler"
    )
    if state is not None:
        optimizer.load_state_dict(state[0])
        scheduler.load_state_dict(state[1])
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates, (plain_round_trip(optimizer.state_dict()), plain_round_trip(scheduler.state_dict()))


@category_check("schedulers")
def check_follows_the_documented_warmup(subject: Subject) -> None:
    found = _warmup(subject)
    if found is None:
        skip_check(
            f"{subject.label}: its options ({subject.component.options_class.__name__}) have no warmup_steps "
            "field (nor one integer field named for a warmup), so there is no documented warmup to check"
        )
    field, warmup = found
    rates, _ = _schedule(subject, TOTAL)
    assert rates[0] > 0, (
        f"{subject.label} with {field}={warmup} runs its first step at learning rate {rates[0]}; "
        f"the kit expects (0 + 1) / {warmup} = {1 / warmup:g} times the base rate (1.0)"
    )
    expected = [(s + 1) / warmup for s in range(warmup)]
    wrong = [
        (s, r, e) for s, (r, e) in enumerate(zip(rates, expected, strict=False)) if not math.isclose(r, e, rel_tol=1e-9)
    ]
    assert not wrong, (
        f"{subject.label} with {field}={warmup} gives {rates[:warmup]} over the warmup; the kit expects "
        f"(s + 1) / W = {expected} (relative tolerance 1e-9); first difference at step {wrong[0][0]}: "
        f"{wrong[0][1]} instead of {wrong[0][2]}"
    )


@category_check("schedulers")
def check_stays_within_zero_and_the_peak(subject: Subject) -> None:
    rates, _ = _schedule(subject, TOTAL)
    bad = [(s, r) for s, r in enumerate(rates) if not (math.isfinite(r) and 0.0 <= r <= 1.0 + 1e-12)]
    assert not bad, (
        f"{subject.label} leaves [0, base_lr] at (step, lr) {bad[:5]} ({len(bad)} of {TOTAL} steps); the kit "
        "expects every rate of the run finite and within [0, 1.0] for a base rate of 1.0"
    )
    assert rates[0] > 0, (
        f"{subject.label} runs its first step at learning rate {rates[0]}; the kit expects it above 0 (a step at "
        "rate 0 is wasted)"
    )


@category_check("schedulers")
def check_state_dict_round_trip_resumes_exactly(subject: Subject) -> None:
    straight, _ = _schedule(subject, TOTAL)
    first, state = _schedule(subject, RESUME_AT)
    rest, _ = _schedule(subject, TOTAL - RESUME_AT, state=state)
    resumed = first + rest
    differing = [step for step, (a, b) in enumerate(zip(resumed, straight, strict=True)) if a != b]
    assert not differing, (
        f"{subject.label}: resuming at step {RESUME_AT} from its state_dict changes the schedule at "
        f"{len(differing)} of {TOTAL} steps, first at step {differing[0]}: {resumed[differing[0]]} instead of "
        f"{straight[differing[0]]}; the kit expects the resumed rates to equal the uninterrupted run's exactly"
    )
