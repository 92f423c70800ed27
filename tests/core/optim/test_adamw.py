"""``adamw`` is torch.optim.AdamW over the weight-decay groups."""

from __future__ import annotations

import torch

STEPS = 6


def test_adamw_matches_torch_adamw_given_the_same_groups_over_several_steps(build_optimizer, make_model, loss_at):
    ours, theirs = make_model(), make_model()
    optimizer = build_optimizer("adamw", ours, lr=1e-2, betas=[0.8, 0.99], eps=1e-7, weight_decay=0.1)
    t = theirs
    reference = torch.optim.AdamW(
        [
            {"params": [t.inner.weight, t.outer.weight], "weight_decay": 0.1},
            {"params": [t.inner.bias, t.norm.weight, t.norm.bias, t.outer.bias], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.8, 0.99),
        eps=1e-7,
    )

    for step in range(STEPS):
        for model, opt in ((ours, optimizer), (theirs, reference)):
            opt.zero_grad()
            loss_at(model, step).backward()
            opt.step()

    for (name, actual), expected in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-15, msg=name)
    assert not torch.equal(ours.inner.weight, make_model().inner.weight)  # the steps did move it
