"""Linear layers whose fp32 CPU matrix products run on oneDNN.

On CPU, ``F.linear`` in fp32 goes through the BLAS PyTorch was built with (MKL's sgemm). On
AMD EPYC processors MKL takes its AVX2 path, about 0.45x of what oneDNN's fp32 GEMM reaches on
the same cores (``benchmarks/bench_train.py`` records both rates). oneDNN ships inside
x86 PyTorch builds, so Forge routes the three products of its own linear layers there: the
forward product, the input gradient and the weight gradient.

The path is taken only where it is the same computation: a plain (not distributed, not
quantized) fp32 tensor on the CPU with autocast off. Everything else (CUDA, bf16 autocast, a
DTensor under tensor parallelism, a float8 weight) goes to ``F.linear`` unchanged. The
results differ from MKL's in the last bits (a different summation order), never in more; a
run is still bitwise reproducible, since each kernel is deterministic for a given thread count.
``[train] cpu_linear_kernel = "aten"`` turns the path off, for bitwise agreement with a plain
PyTorch model.

The products are ``torch.library`` custom ops with their own backward, so ``torch.compile``
keeps them as single opaque calls instead of breaking the graph or re-deriving them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("auto", "onednn", "aten")


def onednn_available() -> bool:
    """Whether this torch build can run fp32 linear products on oneDNN."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# Set per run by set_kernel(); a process-wide switch like torch.backends' flags.
_enabled = onednn_available()


# The shapes "auto" was last decided for in this process (forge_lm.model.linear_choice); the
# default model's products (2048 tokens, dim 256, SwiGLU hidden 704, 257 byte tokens) before any.
_auto_shapes: tuple[tuple[int, int, int], ...] = (
    (2048, 256, 256),
    (2048, 256, 704),
    (2048, 704, 256),
    (2048, 256, 257),
)


def resolve_kernel(kernel: str) -> bool:
    """Whether ``[train] cpu_linear_kernel = kernel`` means oneDNN on this machine: for
    ``"auto"``, where it measured faster than torch's own kernel on the products last chosen
    for (:func:`choose_auto`; :mod:`forge_lm.model.linear_choice`)."""
    if kernel not in KERNELS:
        raise ValueError(f"cpu_linear_kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if kernel == "aten" or not onednn_available():
        return False
    if kernel == "onednn":
        return True
    from forge_lm.model.linear_choice import choose

    return choose(_auto_shapes).onednn


def choose_auto(shapes: list[tuple[int, int, int]]) -> str:
    """Decide ``"auto"`` for these ``(tokens, in, out)`` products from now on; returns why
    (the verdict, measured or cached), for the run's start event."""
    global _auto_shapes
    if not onednn_available():
        return "torch's (aten): this torch build has no oneDNN linear kernel"
    from forge_lm.model.linear_choice import choose

    if shapes:
        _auto_shapes = tuple(sorted(set(shapes)))
    return choose(_auto_shapes).reason


def set_kernel(kernel: str) -> bool:
    """Make Forge's linear layers use ``kernel`` from now on; returns whether oneDNN is on."""
    global _enabled
    _enabled = resolve_kernel(kernel)
    return _enabled


def kernel_in_use() -> str:
    """The kernel fp32 CPU products of Forge's linear layers take now: "onednn" or "aten"."""
    return "onednn" if _enabled else "aten"


@contextlib.contextmanager
def kernel(kernel: str) -> Iterator[None]:
    """Use ``kernel`` inside the block, then restore the previous choice."""
    global _enabled
    before = _enabled
    set_kernel(kernel)
    try:
        yield
    finally:
        _enabled = before


def _takes_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # _enabled already includes oneDNN's availability (set_kernel); dynamo traces this check.
    # type() is exact on purpose: subclasses (DTensor, float8 tensors, FSDP's sharded
    # parameters) carry their own dispatch and must keep it.
    return (
        _enabled
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and type(weight) in (torch.Tensor, nn.Parameter)
        and type(x) in (torch.Tensor, nn.Parameter)
        and not torch.is_autocast_enabled("cpu")
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; its fp32 CPU product on oneDNN where that applies."""
    if not _takes_onednn(x, weight):
        return F.linear(x, weight, bias)
    out = torch.ops.forge.onednn_linear(x, weight)
    return out if bias is None else out + bias


def matmul_nt(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``a @ b_t.T`` for 2-D ``a`` [M, K] and ``b_t`` [N, K] of any strides, on the kernel Forge's
    linear layers take for these tensors (oneDNN for fp32 on the CPU where it applies), without
    autograd: the products of a hand-written backward pass (forge-moe's fused expert loop)."""
    return _onednn_mm(a, b_t) if _takes_onednn(a, b_t) else a @ b_t.t()


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, names, initialisation and layout for tensor parallelism
    and checkpoints) whose fp32 CPU product runs on oneDNN; see the module's docstring."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _onednn_mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``a @ b_t.T`` on oneDNN, for 2-D ``a`` [M, K] and ``b_t`` [N, K] of any strides."""
    if 0 in (*a.shape, b_t.shape[0]):  # oneDNN refuses empty products (an expert with no tokens)
        return a.new_zeros(a.shape[0], b_t.shape[0])
    return torch.ops.mkldnn._linear_pointwise(a, b_t, None, "none", [], "")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D [rows, features] view (reshape(-1, 0) is ambiguous for empty features)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


@torch.library.custom_op("forge::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _onednn_mm(_rows(x), weight).reshape(*x.shape[:-1], weight.shape[0])


@_onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad.T @ x``, [N, K]. For this product oneDNN gains less over MKL than for the other two
    on AMD EPYC (benchmarks/bench_train.py's product table: about 1.0x at the default model's
    width, 1.4x to 1.5x on wider layers, against about 2x): its reduction runs over every token
    of the batch."""
    return _onednn_mm(grad.t(), x.t())


@torch.library.custom_op("forge::onednn_linear_backward", mutates_args=())
def _onednn_linear_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_input: bool, need_weight: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    flat_grad, flat_x = _rows(grad), _rows(x)
    # grad @ weight is (grad) @ (weight.T).T: oneDNN takes the transposed view without a copy.
    grad_x = _onednn_mm(flat_grad, weight.t()).reshape(x.shape) if need_input else x.new_empty(0)
    grad_w = _weight_grad(flat_grad, flat_x) if need_weight else weight.new_empty(0)
    return grad_x, grad_w


@_onednn_linear_backward.register_fake
def _(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_input: bool, need_weight: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return (x.new_empty(x.shape) if need_input else x.new_empty(0)), (
        weight.new_empty(weight.shape) if need_weight else weight.new_empty(0)
    )


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    x, weight = inputs
    ctx.save_for_backward(x, weight)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    x, weight = ctx.saved_tensors
    need_input, need_weight = ctx.needs_input_grad
    grad_x, grad_w = torch.ops.forge.onednn_linear_backward(grad, x, weight, need_input, need_weight)
    return (grad_x if need_input else None), (grad_w if need_weight else None)


_onednn_linear.register_autograd(_backward, setup_context=_setup_context)
