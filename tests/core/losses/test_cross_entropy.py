"""``cross_entropy``: the token mean of -log softmax at the label, plus an optional z-loss."""

from __future__ import annotations

import pytest
import torch

from forge_lm.components import IGNORE_INDEX
from forge_lm.losses.aux import collect_aux

WEIGHTS = [0.0, 1e-2, 0.5]


@pytest.mark.parametrize("z_loss_weight", WEIGHTS)
def test_cross_entropy_value_and_gradient_match_the_formula(z_loss_weight, build_loss, problem, expected):
    logits, labels = problem(torch.float64)  # float64 is kept, not narrowed: a tight comparison
    loss = build_loss("cross_entropy", z_loss_weight=z_loss_weight)(logits, labels)
    loss.backward()

    want = expected(logits, labels, z_loss_weight)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, torch.tensor(want["loss"], dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(logits.grad, want["grad"], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("z_loss_weight", WEIGHTS)
def test_cross_entropy_in_fp32_matches_the_formula_to_fp32_precision(z_loss_weight, build_loss, problem, expected):
    logits, labels = problem(torch.float32)
    loss = build_loss("cross_entropy", z_loss_weight=z_loss_weight)(logits, labels)
    loss.backward()

    want = expected(logits, labels, z_loss_weight)
    torch.testing.assert_close(loss.double(), torch.tensor(want["loss"], dtype=torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(logits.grad.double(), want["grad"], rtol=1e-5, atol=1e-7)


def test_bf16_logits_give_an_fp32_loss_of_their_upcast_values(build_loss, problem, expected):
    logits, labels = problem(torch.bfloat16)
    loss = build_loss("cross_entropy", z_loss_weight=1e-2)(logits, labels)

    assert loss.dtype == torch.float32
    want = expected(logits, labels, 1e-2)["loss"]
    torch.testing.assert_close(loss.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)


def test_the_weighted_z_loss_is_reported_as_a_term_of_the_returned_loss(build_loss, problem, expected):
    logits, labels = problem(torch.float64)
    with collect_aux() as collected:
        loss = build_loss("cross_entropy", z_loss_weight=1e-2)(logits, labels)

    assert collected.loss_terms.keys() == {"z_loss"}
    z_term = collected.loss_terms["z_loss"].item()
    assert z_term == pytest.approx(1e-2 * expected(logits, labels, 0.0)["z"], rel=1e-12)
    assert not collected.losses  # the z-loss is part of the returned loss, not an extra aux loss
    # What is logged as the loss: the cross-entropy alone, as torch computes it.
    reference = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    assert collected.data_loss(loss).item() == pytest.approx(reference.item(), rel=1e-12)
    assert collected.logged() == {"z_loss": pytest.approx(z_term, rel=1e-15)}


def test_without_z_loss_nothing_is_logged(build_loss, problem):
    logits, labels = problem()
    with collect_aux() as collected:
        build_loss("cross_entropy")(logits, labels)

    assert collected.metrics == {}
    assert collected.loss_terms == {}


def test_z_loss_is_off_by_default(build_loss, problem, expected):
    logits, labels = problem(torch.float64)
    loss = build_loss("cross_entropy")(logits, labels)

    torch.testing.assert_close(loss, torch.tensor(expected(logits, labels, 0.0)["loss"], dtype=torch.float64))
