"""forge_lm.model.linear: fp32 CPU products on oneDNN, everything else through F.linear.

The reference is F.linear in float64 (the exact product up to fp32 inputs); the oneDNN path
must match it as closely as torch's own fp32 kernel does, take effect only where it is the
same computation, and leave a model bitwise equal to plain nn.Linear when turned off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from forge_lm.errors import ConfigError
from forge_lm.model import linear as forge_linear
from forge_lm.model.linear import Linear, kernel, kernel_in_use, onednn_available

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear kernel")


class CountOps(torch.overrides.TorchFunctionMode):
    """Counts the F.linear calls a block makes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.linear += 1
        return func(*args, **(kwargs or {}))


def _count_onednn(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = forge_linear._onednn_mm

    def counted(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return real(a, b)

    monkeypatch.setattr(forge_linear, "_onednn_mm", counted)
    return calls


def _forward_backward(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    out.backward(grad)
    grads = [p.grad for p in layer.parameters()]
    return (out.detach(), x.grad, *grads)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(7, 33), (3, 5, 33)])
def test_onednn_matches_the_exact_product_as_closely_as_torch(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    layer = Linear(33, 19, bias=bias)
    x, grad = torch.randn(shape), torch.randn(*shape[:-1], 19)
    with kernel("onednn"):
        ours = _forward_backward(layer, x, grad)
    with kernel("aten"):
        torchs = _forward_backward(layer, x, grad)
    reference = Linear(33, 19, bias=bias).double()
    reference.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    exact = _forward_backward(reference, x.double(), grad.double())
    for mine, theirs, truth in zip(ours, torchs, exact, strict=True):
        assert mine.dtype == torch.float32
        assert mine.shape == truth.shape
        torch_error = (theirs.double() - truth).abs().max().item()
        our_error = (mine.double() - truth).abs().max().item()
        assert our_error <= max(4 * torch_error, 1e-6), (our_error, torch_error)


def test_the_three_products_take_onednn_on_cpu_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_onednn(monkeypatch)
    layer = Linear(16, 8, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    with kernel("onednn"), CountOps() as ops:
        layer(x).sum().backward()
    assert calls[0] == 3  # forward, input gradient, weight gradient
    assert ops.linear == 0


def test_only_the_needed_gradients_are_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_onednn(monkeypatch)
    layer = Linear(16, 8, bias=False).requires_grad_(False)
    x = torch.randn(4, 16, requires_grad=True)
    with kernel("onednn"):
        layer(x).sum().backward()
    assert calls[0] == 2  # forward and the input gradient; no weight gradient for a frozen weight
    assert layer.weight.grad is None


@pytest.mark.parametrize(
    "case",
    ["aten", "bf16 autocast", "bf16 weight", "float64"],
)
def test_everything_else_goes_to_f_linear(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_onednn(monkeypatch)
    layer = Linear(16, 8, bias=False)
    x = torch.randn(4, 16)
    chosen = "aten" if case == "aten" else "onednn"
    if case == "bf16 weight":
        layer, x = layer.bfloat16(), x.bfloat16()
    if case == "float64":
        layer, x = layer.double(), x.double()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16 autocast")
    with kernel(chosen), CountOps() as ops, autocast:
        out = layer(x)
    assert calls[0] == 0
    assert ops.linear == 1
    if case == "bf16 autocast":
        assert out.dtype == torch.bfloat16  # autocast still applies: the product ran in bf16


def test_a_dtensor_weight_keeps_its_own_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    # A tensor subclass (DTensor under tensor parallelism, a float8 weight) is never handed to
    # the oneDNN op, which would see only its local storage.
    class Tagged(torch.Tensor):
        pass

    calls = _count_onednn(monkeypatch)
    weight = torch.randn(8, 16).as_subclass(Tagged)
    with kernel("onednn"):
        forge_linear.linear(torch.randn(4, 16), weight)
    assert calls[0] == 0


def test_aten_is_bitwise_a_plain_nn_linear() -> None:
    torch.manual_seed(0)
    ours = Linear(32, 24)
    plain = nn.Linear(32, 24)
    plain.load_state_dict(ours.state_dict())
    x, grad = torch.randn(5, 32), torch.randn(5, 24)
    with kernel("aten"):
        mine = _forward_backward(ours, x, grad)
    for a, b in zip(mine, _forward_backward(plain, x, grad), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("rows", "features"), [(0, 16), (4, 0)])
def test_empty_products_are_zeros_with_gradients(rows: int, features: int) -> None:
    # an expert that received no tokens, or a layer with no inputs: oneDNN itself refuses them
    layer = Linear(features, 8, bias=False)
    x = torch.randn(rows, features, requires_grad=True)
    with kernel("onednn"):
        out = layer(x)
        out.sum().backward()
    assert out.shape == (rows, 8)
    assert not out.any()
    assert x.grad.shape == (rows, features)
    assert layer.weight.grad.shape == (8, features)
    assert not layer.weight.grad.any()


def test_onednn_is_deterministic() -> None:
    torch.manual_seed(0)
    layer = Linear(64, 48)
    x, grad = torch.randn(2, 37, 64), torch.randn(2, 37, 48)
    with kernel("onednn"):
        first = _forward_backward(layer, x, grad)
        second = _forward_backward(layer, x, grad)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_the_custom_op_passes_torch_library_checks() -> None:
    # schema, fake (meta) implementation, autograd registration, and dispatch consistency
    x, w = torch.randn(6, 10, requires_grad=True), torch.randn(4, 10, requires_grad=True)
    torch.library.opcheck(torch.ops.forge.onednn_linear.default, (x, w))


def test_compiles_without_a_graph_break() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = Linear(16, 8)
    x = torch.randn(3, 16)
    with kernel("onednn"):
        eager = layer(x)
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)  # fullgraph: a break raises
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_kernel_names_are_checked_and_a_missing_onednn_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="cpu_linear_kernel must be one of"):
        forge_linear.resolve_kernel("mkl")
    from forge_lm.train import parts

    monkeypatch.setattr(forge_linear, "_enabled", forge_linear._enabled)  # restored after the test
    monkeypatch.setattr(forge_linear, "onednn_available", lambda: False)
    with pytest.raises(ConfigError, match="set it to 'auto' or 'aten'"):
        parts.choose_linear_kernel("onednn", torch.device("cpu"))
    parts.choose_linear_kernel("auto", torch.device("cpu"))  # auto falls back quietly
    assert kernel_in_use() == "aten"
    parts.choose_linear_kernel("onednn", torch.device("cuda"))  # a CUDA run never needs it
