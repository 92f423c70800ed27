"""A skipped non-finite step leaves no trace in the sigmoid router's next bias update."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from forge_lm.train.loop import _handle_bad_step  # the loop's policy for a non-finite step

ROUTER = {"router": {"name": "sigmoid_topk", "bias_update_rate": 0.5}}


def _context(model):
    policy = SimpleNamespace(nan_policy="skip", max_bad_steps=5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    return SimpleNamespace(config=SimpleNamespace(resilience=policy), model=model, optimizer=optimizer, step=1)


def _biases(model):
    return [layer.feed_forward.router.expert_bias.clone() for layer in model.layers]


def _run(make_moe_model, moe_manager, bad_batch, skip_hook=True):
    """Step 1 on ``good[0]``; then, if given, the bad batch's forward and its skip; step 2 on ``good[1]``."""
    model = make_moe_model(ROUTER).train()
    generator = torch.Generator().manual_seed(1)
    good = [torch.randint(0, 61, (2, 12), generator=generator) for _ in range(2)]
    context = _context(model)
    model(good[0])
    moe_manager.call("forge_lm_step_end", context=context, step=1, metrics={})
    if bad_batch is not None:
        model(bad_batch)  # its loss came out NaN: the loop skips the step
        if skip_hook:
            run = SimpleNamespace(context=context, manager=moe_manager)  # what the policy reads of the Run
            _handle_bad_step(run, float("nan"), float("nan"), 1)
    model(good[1])
    moe_manager.call("forge_lm_step_end", context=context, step=2, metrics={})
    return _biases(model)


def test_after_a_skipped_step_the_bias_update_is_that_of_a_run_without_the_bad_batch(
    make_moe_model, moe_manager, capsys
):
    bad = torch.full((8, 12), 7)  # one token everywhere: its experts get all of the bad batch's load
    skipped = _run(make_moe_model, moe_manager, bad)
    never_seen = _run(make_moe_model, moe_manager, None)
    for after_skip, reference in zip(skipped, never_seen, strict=True):
        assert torch.equal(after_skip, reference)
    assert "skipped the step" in capsys.readouterr().err
    # Without the skip's clean-up the bad batch's counts would move the bias: the check can fail.
    kept = _run(make_moe_model, moe_manager, bad, skip_hook=False)
    assert any(not torch.equal(a, b) for a, b in zip(kept, never_seen, strict=True))


def test_the_skip_clears_every_sigmoid_routers_pending_load(make_moe_model, moe_manager):
    model = make_moe_model(ROUTER).train()
    model(torch.randint(0, 61, (2, 12)))
    routers = [layer.feed_forward.router for layer in model.layers]
    assert all(router.pending_load.sum() > 0 for router in routers)
    moe_manager.call("forge_lm_step_skipped", context=SimpleNamespace(model=model), step=0)
    assert all(router.pending_load.sum() == 0 for router in routers)
    assert all(router.expert_bias.abs().sum() == 0 for router in routers)  # no update from a skipped step
