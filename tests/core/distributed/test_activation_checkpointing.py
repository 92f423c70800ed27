"""Activation checkpointing changes memory, never numbers, and keeps parameter names."""

from __future__ import annotations

import pytest
import torch

from forge_lm.config import load_config
from forge_lm.distributed import ParallelDims, TransformContext, apply_model_transforms
from forge_lm.model import build_model


def _model_and_context(manager, mode: str):
    config = load_config(
        None,
        ["--model.dim=64", "--model.n_layers=2", f"--train.activation_checkpointing={mode}"],
        manager.registry,
    )
    torch.manual_seed(0)
    model = build_model(config.model, 97, manager.registry)
    return model, TransformContext(config, ParallelDims(), None, torch.device("cpu"), None)


def _loss_and_grads(model, ids, documents):
    model.zero_grad(set_to_none=True)
    logits = model(ids, documents)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("with_documents", [False, True])
def test_same_loss_and_gradients_as_without(manager, mode, with_documents) -> None:
    reference, _ = _model_and_context(manager, "none")
    model, context = _model_and_context(manager, mode)
    assert apply_model_transforms(model, context, manager.registry) == ["activation_checkpointing"]
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    ids = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(1))
    documents = torch.tensor([0] * 10 + [1] * 14).expand(3, 24) if with_documents else None
    expected_loss, expected = _loss_and_grads(reference, ids, documents)
    loss, grads = _loss_and_grads(model, ids, documents)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def _count_feed_forward_calls(model) -> list[int]:
    calls = []
    for block in model.layers:
        inner = block.feed_forward.forward
        block.feed_forward.forward = lambda x, inner=inner: calls.append(1) or inner(x)
    return calls


def test_full_recomputes_each_block_in_backward(manager) -> None:
    ids = torch.randint(0, 97, (2, 8))
    reference, _ = _model_and_context(manager, "none")
    model, context = _model_and_context(manager, "full")
    apply_model_transforms(model, context, manager.registry)
    reference_calls, calls = _count_feed_forward_calls(reference), _count_feed_forward_calls(model)
    reference(ids).sum().backward()
    model(ids).sum().backward()
    assert len(reference_calls) == 2
    assert len(calls) == 4  # forward once, then again in backward
    with torch.no_grad():  # evaluation: nothing to recompute
        model(ids)
    assert len(calls) == 6


def test_selective_keeps_the_matmuls(manager) -> None:
    """Selective checkpointing recomputes element-wise work only: fewer ops rerun than 'full'."""
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.randint(0, 97, (2, 16))
    flops = {}
    for mode in ("none", "full", "selective"):
        model, context = _model_and_context(manager, mode)
        apply_model_transforms(model, context, manager.registry)
        with FlopCounterMode(display=False) as counter:
            model(ids).sum().backward()
        flops[mode] = counter.get_total_flops()
    assert flops["full"] > flops["none"]  # the blocks' matmuls run again
    assert flops["selective"] == flops["none"]  # no matmul is recomputed
