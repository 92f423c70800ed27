"""Loss contract: ``factory(options) -> loss_fn(logits, labels) -> scalar``, a mean over the
positions whose label is not :data:`~forge_lm.components.IGNORE_INDEX`.

Extra: ``reference=callable(logits, labels)``, an independent implementation to match.
"""

from __future__ import annotations

import torch

from forge_lm.components import IGNORE_INDEX
from forge_lm.plugins import CORE_DISTRIBUTION
from forge_lm.testing._kit import Subject, category_check

BATCH, SEQ, VOCAB = 4, 6, 11


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, SEQ, VOCAB, generator=generator) * 3
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels[:, :2] = IGNORE_INDEX  # some ignored positions in every row
    labels[1, 4] = IGNORE_INDEX
    return logits, labels


def _loss(subject: Subject, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = subject.build()(logits, labels)
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0, (
        f"{subject.label} must return a scalar tensor (0 dimensions); it returned "
        f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
    )
    return loss


@category_check("losses")
def check_is_finite_with_finite_gradients(subject: Subject) -> None:
    logits, labels = _problem()
    logits.requires_grad_(True)
    loss = _loss(subject, logits, labels)
    loss.backward()
    assert torch.isfinite(loss), f"{subject.label} returned {loss.item()}; the kit expects a finite loss"
    assert logits.grad is not None, f"{subject.label} passes no gradient to the logits; the kit expects one"
    bad = int((~torch.isfinite(logits.grad)).sum())
    assert bad == 0, (
        f"{subject.label} has non-finite gradients at {bad} of {logits.grad.numel()} logits; the kit expects none"
    )


@category_check("losses")
def check_ignores_positions_labelled_ignore_index(subject: Subject) -> None:
    logits, labels = _problem()
    logits.requires_grad_(True)
    _loss(subject, logits, labels).backward()
    ignored = labels == IGNORE_INDEX
    leaked = logits.grad[ignored].abs().max().item()
    assert leaked == 0, (
        f"{subject.label} passes gradient to ignored positions (up to {leaked:.3g} in magnitude at "
        f"{int(ignored.sum())} positions labelled IGNORE_INDEX); the kit expects exactly 0 there"
    )
    changed = logits.detach().clone()
    changed[ignored] = torch.randn(int(ignored.sum()), VOCAB) * 10
    before, after = _loss(subject, logits.detach(), labels), _loss(subject, changed, labels)
    torch.testing.assert_close(
        after,
        before,
        msg=lambda detail: (
            f"{subject.label} depends on logits at ignored positions: {before.item():.6g} becomes {after.item():.6g} "
            f"when they change; the kit expects equality within torch.testing.assert_close's tolerance\n{detail}"
        ),
    )


@category_check("losses")
def check_is_a_mean_over_counted_tokens(subject: Subject) -> None:
    # Gradient accumulation relies on this: the loss of a batch is the token-weighted mean of
    # the losses of its parts.
    logits, labels = _problem()
    whole = _loss(subject, logits, labels)
    parts = [(logits[:1], labels[:1]), (logits[1:], labels[1:])]
    counts = [int((part_labels != IGNORE_INDEX).sum()) for _, part_labels in parts]
    weighted = sum(n * _loss(subject, lg, lb) for (lg, lb), n in zip(parts, counts, strict=True)) / sum(counts)
    torch.testing.assert_close(
        whole,
        weighted,
        msg=lambda detail: (
            f"{subject.label} is not a mean over non-ignored tokens: the whole batch gives {whole.item():.6g}, "
            f"the token-weighted mean of its two parts {weighted.item():.6g}; the kit expects them equal within "
            f"torch.testing.assert_close's tolerance\n{detail}"
        ),
    )


@category_check("losses")
def check_matches_its_reference(subject: Subject) -> None:
    reference = subject.extras.get("reference")
    if reference is None:
        if subject.component.plugin.distribution != CORE_DISTRIBUTION:
            raise AssertionError(
                f"{subject.label}: give the kit an independent implementation to compare with: "
                "component_checks('losses', name, reference=my_reference)"
            )
        from forge_lm.testing._references import LOSS_REFERENCES

        reference = LOSS_REFERENCES[subject.component.name]
    logits, labels = _problem(seed=3)
    got, want = _loss(subject, logits, labels), torch.as_tensor(reference(logits, labels)).to(torch.float32)
    torch.testing.assert_close(
        got,
        want,
        msg=lambda detail: (
            f"{subject.label} differs from its reference: {got.item():.6g} against {want.item():.6g}; the kit "
            f"expects them equal within torch.testing.assert_close's float32 tolerance\n{detail}"
        ),
    )
