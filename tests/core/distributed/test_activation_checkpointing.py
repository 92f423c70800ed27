"""Activation checkpointing changes memory, never numbers, and keeps parameter names."""

from __future__ import annotations

import collections

import pytest
import torch

from forge_lm.config import load_config
from forge_lm.distributed import ParallelDims, TransformContext, apply_model_transforms
from forge_lm.distributed.activation_checkpointing import saved_ops
from forge_lm.model import build_model
from forge_lm.model.linear import kernel as linear_kernel
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing.counters import OpCounter


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


def _forward_and_backward_ops(model, ids) -> tuple[collections.Counter, collections.Counter, dict]:
    model.zero_grad(set_to_none=True)
    with OpCounter() as forward:
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
    with OpCounter() as backward:
        loss.backward()
    return forward.counts, backward.counts, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module", params=["auto", "aten"])
def dense_runs(request):
    """Forward and backward op counts and gradients of one dense model per checkpointing mode,
    with Forge's linear layers on their custom op (``auto``) and on plain ``aten.mm``."""
    manager = PluginManager(PluginSettings(autoload=False))
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    runs = {}
    with linear_kernel(request.param):
        for mode in ("none", "full", "selective"):
            model, context = _model_and_context(manager, mode)
            apply_model_transforms(model, context, manager.registry)
            runs[mode] = _forward_and_backward_ops(model, ids)
    return runs


def test_selective_recomputes_no_saved_op_and_full_recomputes_them(dense_runs) -> None:
    """Backward under selective checkpointing runs exactly the matmuls and attention kernels of
    backward without checkpointing (none recomputed); under full checkpointing it runs more of
    each kind. Gradients are bitwise those without checkpointing."""
    forward, plain, expected = dense_runs["none"]
    saved = saved_ops()
    in_forward = {op: n for op, n in forward.items() if op in saved}
    # The blocks' projections and attention reach the dispatcher as saved ops (2 blocks x 7
    # projections at least, plus attention): otherwise the test would prove nothing.
    assert sum(in_forward.values()) >= 2 * 7 + 2, forward
    _, selective, selective_grads = dense_runs["selective"]
    _, full, full_grads = dense_runs["full"]
    for op in saved:
        assert selective[op] == plain[op], op
    # Full checkpointing reruns the blocks' forward, projections and attention included (up to
    # the last op whose output backward needs: torch stops a recomputation early there).
    for op in in_forward:
        assert full[op] > plain[op], op
    for name, grad in expected.items():
        torch.testing.assert_close(selective_grads[name], grad, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(full_grads[name], grad, rtol=0, atol=0, msg=name)


def test_the_saved_list_names_dispatcher_level_ops() -> None:
    """Composite ops (``aten.linear``, ``aten.matmul``) never reach a checkpoint policy; the list
    holds what they decompose into, and each entry this torch has is there."""
    names = {str(op) for op in saved_ops()}
    assert not any(name.startswith(("aten.linear", "aten.matmul")) for name in names)
    assert {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"} <= names
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in names
    if hasattr(torch.ops.aten, "_grouped_mm"):
        assert "aten._grouped_mm.default" in names
    for collective in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "all_reduce"):
        assert f"_c10d_functional.{collective}.default" in names
    assert not any(name.endswith(".out") for name in names)  # out= variants have no output to keep
