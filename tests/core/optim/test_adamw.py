"""``adamw`` is torch.optim.AdamW over the weight-decay groups."""

from __future__ import annotations

import pytest
import torch

from forge_lm.errors import ConfigError
from forge_lm.optim.adamw import implementation_flags

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


def test_auto_takes_torchs_fused_kernel_on_cpu(build_optimizer, make_model):
    optimizer = build_optimizer("adamw", make_model())
    assert all(group["fused"] for group in optimizer.param_groups)


@pytest.mark.parametrize(
    ("implementation", "flags"),
    [("fused", {"fused": True}), ("foreach", {"foreach": True}), ("for-loop", {"foreach": False})],
)
def test_each_implementation_is_torchs_adamw_with_its_flag_bit_for_bit(
    build_optimizer, make_model, loss_at, implementation, flags
):
    ours, theirs = make_model(), make_model()
    optimizer = build_optimizer("adamw", ours, lr=1e-2, weight_decay=0.0, implementation=implementation)
    reference = torch.optim.AdamW(theirs.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, **flags)
    for step in range(STEPS):
        for model, opt in ((ours, optimizer), (theirs, reference)):
            opt.zero_grad()
            loss_at(model, step).backward()
            opt.step()
    for actual, expected in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(actual, expected)


def test_auto_leaves_devices_without_a_fused_kernel_to_torch():
    meta = [torch.empty(2, device="meta")]  # torch has no fused AdamW for the meta device
    assert implementation_flags("auto", meta) == {}
    assert implementation_flags("auto", [torch.empty(2)]) == {"fused": True}


def test_an_unknown_implementation_is_refused_with_the_choices(options_of):
    with pytest.raises(ConfigError, match=r"implementation.*'auto', 'fused', 'foreach', 'for-loop'"):
        options_of("adamw", implementation="fast")
