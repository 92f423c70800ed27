"""``torch.compile`` per block: a dense block compiles into one graph with no break (also under
activation checkpointing), gives the eager numbers, and recompiles only once for a new
sequence length; the hooks around a block (FSDP2's) stay outside its graph. Compiled with the
``aot_eager`` backend (AOTAutograd, as inductor uses it, without generating kernels: inductor
would take minutes here)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from forge_lm.config import load_config
from forge_lm.distributed import TRANSFORM_ORDER
from forge_lm.distributed.activation_checkpointing import checkpointed
from forge_lm.distributed.compile import compile_block
from forge_lm.model import build_model
from forge_lm.model.linear import kernel as linear_kernel
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing.counters import CountingBackend


def _model(seed: int = 0):
    manager = PluginManager(PluginSettings(autoload=False))
    config = load_config(None, ["--model.dim=64", "--model.n_layers=2"], manager.registry)
    torch.manual_seed(seed)
    return build_model(config.model, 97, manager.registry)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


# "auto": Forge's linear layers on their oneDNN custom op (forge_lm.model.linear); "aten": F.linear.
@pytest.mark.parametrize("kernel", ["auto", "aten"])
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_dense_block_compiles_without_a_graph_break_and_matches_eager(kernel) -> None:
    reference, model = _model(), _model()
    backend = CountingBackend()
    for block in model.layers:
        compile_block(block, backend=backend)
    with linear_kernel(kernel):
        for length in (16, 16, 12, 9):  # a new length recompiles once, with the length symbolic
            ids = torch.randint(0, 97, (2, length), generator=torch.Generator().manual_seed(length))
            expected_logits, expected = _loss_and_grads(reference, ids)
            logits, grads = _loss_and_grads(model, ids)
            torch.testing.assert_close(logits, expected_logits, rtol=1e-6, atol=1e-6)
            for name, grad in expected.items():
                torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert dict(counters["graph_break"]) == {}
    # Both blocks share the graph; one more for the first new length (then dynamic).
    assert backend.graphs == 2


def test_compile_comes_before_fsdp_and_leaves_the_module_call_alone(monkeypatch) -> None:
    """FSDP2 wraps the compiled blocks: its hooks, registered on the module, run around the
    compiled forward, never inside a graph."""
    assert TRANSFORM_ORDER.index("activation_checkpointing") < TRANSFORM_ORDER.index("compile")
    assert TRANSFORM_ORDER.index("compile") < TRANSFORM_ORDER.index("data_parallel")
    model = _model()
    block = model.layers[0]
    traced = []
    monkeypatch.setattr(torch, "compile", lambda forward, **options: traced.append(forward) or forward)
    compile_block(block, backend="eager")
    assert traced == [block.__class__.forward.__get__(block)]  # the bound forward, not _call_impl
    calls = []
    block.register_forward_pre_hook(lambda module, args: calls.append("hook"))
    x = torch.randn(1, 4, 64)
    cos, sin = model.rope(0, 4)
    block(x, cos, sin, None, True, None)
    assert calls == ["hook"]


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_checkpointed_dense_block_compiles_whole_with_the_same_gradients() -> None:
    """Compile comes after activation checkpointing: the checkpointed forward is traced as one
    graph (recomputation included), with the gradients of the plain eager model."""
    reference, model = _model(), _model()
    backend = CountingBackend()
    for block in model.layers:
        block.forward = checkpointed(block.forward, "selective")
        compile_block(block, backend=backend)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(5))
    _, expected = _loss_and_grads(reference, ids)
    _, grads = _loss_and_grads(model, ids)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert dict(counters["graph_break"]) == {}
    assert backend.graphs == 1
