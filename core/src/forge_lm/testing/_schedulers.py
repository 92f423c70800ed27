"""Scheduler contract: ``factory(options, optimizer, total_steps) -> LRScheduler``.

With ``warmup_steps = W`` the step with index ``s < W`` runs at ``base_lr * (s + 1) / W``.
"""

from __future__ import annotations

import math

import torch

from forge_lm.testing._kit import Subject, category_check
from forge_lm.testing._tiny import plain_round_trip

TOTAL, WARMUP = 100, 10


def _schedule(subject: Subject, steps: int, state: tuple[object, object] | None = None) -> tuple[list[float], tuple]:
    """Learning rates of ``steps`` consecutive steps (base lr 1.0), and the final state."""
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    overrides = {"warmup_steps": WARMUP} if subject.has_option("warmup_steps") else {}
    scheduler = subject.build(optimizer, TOTAL, options=subject.options(**overrides))
    assert isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler), (
        f"{subject.label} returned {type(scheduler).__name__}, not a torch LRScheduler"
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
    rates, _ = _schedule(subject, TOTAL)
    assert rates[0] > 0, f"{subject.label} runs its first step at learning rate {rates[0]}"
    if subject.has_option("warmup_steps"):
        expected = [(s + 1) / WARMUP for s in range(WARMUP)]
        assert all(math.isclose(r, e, rel_tol=1e-9) for r, e in zip(rates, expected, strict=False)), (
            f"{subject.label} with warmup_steps={WARMUP} gives {rates[:WARMUP]}, expected (s + 1) / W = {expected}"
        )


@category_check("schedulers")
def check_stays_within_zero_and_the_peak(subject: Subject) -> None:
    rates, _ = _schedule(subject, TOTAL)
    bad = [(s, r) for s, r in enumerate(rates) if not (math.isfinite(r) and 0.0 <= r <= 1.0 + 1e-12)]
    assert not bad, f"{subject.label} leaves [0, base_lr] at (step, lr) {bad[:5]}"


@category_check("schedulers")
def check_state_dict_round_trip_resumes_exactly(subject: Subject) -> None:
    straight, _ = _schedule(subject, TOTAL)
    first, state = _schedule(subject, 37)
    rest, _ = _schedule(subject, TOTAL - 37, state=state)
    differing = [step for step, (a, b) in enumerate(zip(first + rest, straight, strict=True)) if a != b]
    assert not differing, (
        f"{subject.label}: resuming at step 37 from its state_dict changes the schedule from step {differing[:1]}"
    )
