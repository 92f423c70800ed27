"""Packed experts: dispatch with a capacity limit, and the SwiGLU of every expert at once.

The experts' weights are stacked, one tensor per projection, in ``nn.Linear``'s layout per
expert: ``w1`` (gate) and ``w3`` (up) ``[E, hidden, dim]``, ``w2`` (down) ``[E, dim, hidden]``.
The routed (token, expert) assignments are sorted by expert, so each expert's rows are
contiguous, and the three projections run over all experts together:

- ``grouped_mm``: ``torch._grouped_mm`` with the experts' row offsets (one kernel per projection);
- ``padded``: rows scattered into a ``[E, rows of the busiest expert (or the capacity), dim]``
  buffer and ``torch.bmm``; the padding is computed and thrown away;
- ``loop``: one matmul per expert, a Python loop; the reference the others are tested against.

Capacity rule (:func:`dispatch`): with capacity ``C``, each expert keeps at most ``C`` of the
assignments routed to it, in priority order: first choices before second choices (the
``j``-th column of the router's indices before column ``j + 1``), then token order in the
flattened ``[batch * seq]`` input; the rest are dropped and contribute nothing (the token
keeps its other experts, its shared experts and the residual).
"""

from __future__ import annotations

import functools
import math
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from forge_lm.api import linear, linear_kernel_in_use, matmul_nt, record_event

KERNELS = ("auto", "grouped_mm", "padded", "loop")


def capacity(capacity_factor: float, tokens: int, top_k: int, n_experts: int) -> int:
    """``C = ceil(capacity_factor * tokens * top_k / n_experts)`` (float noise rounded off first)."""
    return max(1, math.ceil(round(capacity_factor * tokens * top_k / n_experts, 9)))


class Dispatch(NamedTuple):
    """Where the kept assignments go. Slot ``s = t * top_k + j`` is token ``t``'s ``j``-th choice."""

    slots: torch.Tensor  # [M] kept slots, sorted by expert, then priority (choice, token)
    experts: torch.Tensor  # [M] the expert of each kept slot (non-decreasing)
    counts: torch.Tensor  # [E] kept slots per expert
    assigned: torch.Tensor  # [E] slots routed to each expert before dropping
    dropped: torch.Tensor  # scalar: slots dropped by the capacity limit


def count_per_expert(flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many entries of ``flat`` (expert indices) name each of the ``n_experts`` experts.

    A scatter-add into ``n_experts`` zeros rather than ``torch.bincount``, whose output length
    depends on the largest index (a value ``torch.compile`` cannot know without reading it)."""
    return flat.new_zeros(n_experts).scatter_add_(0, flat, torch.ones_like(flat))


def dispatch(indices: torch.Tensor, n_experts: int, capacity_limit: int | None = None) -> Dispatch:
    """Sort the assignments of ``indices`` (``[tokens, top_k]``) by expert and apply the capacity rule."""
    tokens, top_k = indices.shape
    flat = indices.reshape(-1)  # position s = t * top_k + j
    # Slots in priority order: every token's first choice, then every token's second, ...
    priority = torch.arange(tokens * top_k, device=indices.device).view(tokens, top_k).t().reshape(-1)
    slots = priority[torch.argsort(flat[priority], stable=True)]  # by expert; ties keep the priority order
    experts = flat[slots]
    assigned = count_per_expert(flat, n_experts)
    if capacity_limit is None:  # every shape here follows from the input's: no sync, no recompile
        return Dispatch(slots, experts, assigned, assigned, assigned.new_zeros(()))
    starts = assigned.cumsum(0) - assigned
    rank = torch.arange(slots.numel(), device=slots.device) - starts[experts]  # position within its expert
    # The kept slots' number depends on the routing: this selection is the one data-dependent
    # shape of a layer that drops (under torch.compile, the graph ends here).
    keep = rank < capacity_limit
    counts = assigned.clamp(max=capacity_limit)
    return Dispatch(slots[keep], experts[keep], counts, assigned, flat.numel() - counts.sum())


# -- kernels ------------------------------------------------------------------------------------


def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x[rows of e] @ weight[e].T`` for every expert ``e``; ``weight`` is ``[E, out, in]``."""
    out = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    if out.requires_grad:
        # torch._grouped_mm's backward rejects expanded gradients (strides 0), such as that of a
        # ``.sum()``: make the incoming gradient contiguous first. (A hook rather than an identity
        # autograd function, whose output would be a view: FSDP2 warns about views it returns.)
        out.register_hook(torch.Tensor.contiguous)
    return out


def _grouped_swiglu(x, counts, w1, w3, w2, pad_to):
    offsets = counts.cumsum(0).to(torch.int32)
    hidden = F.silu(_grouped(x, w1, offsets)) * _grouped(x, w3, offsets)
    return _grouped(hidden, w2, offsets)


def _padded_swiglu(x, counts, w1, w3, w2, pad_to):
    n_experts = w1.shape[0]
    # Without a capacity the buffer is as long as the busiest expert's rows: reading that count
    # is a host sync (and, compiled, a graph break), which the grouped kernel does not need.
    experts = torch.repeat_interleave(torch.arange(n_experts, device=x.device), counts, output_size=x.shape[0])
    rank = torch.arange(x.shape[0], device=x.device) - (counts.cumsum(0) - counts)[experts]
    rows = pad_to if pad_to is not None else int(counts.max()) if x.shape[0] else 0
    padded = x.new_zeros(n_experts, rows, x.shape[-1])
    padded[experts, rank] = x
    hidden = F.silu(torch.bmm(padded, w1.transpose(-2, -1))) * torch.bmm(padded, w3.transpose(-2, -1))
    return torch.bmm(hidden, w2.transpose(-2, -1))[experts, rank]


def _loop_swiglu(x, counts, w1, w3, w2, pad_to):
    # One product per expert and projection, each through Forge's linear: on CPU in fp32 that is
    # oneDNN's GEMM (forge_lm.model.linear), which torch._grouped_mm and bmm do not reach.
    # split and unbind, not slicing and indexing: their backward passes concatenate and stack
    # the pieces' gradients once, where each slice or index would add its gradient into a zero
    # tensor the size of the whole.
    sizes = counts.tolist()  # the split sizes: a host read (free on the CPU)
    pieces = zip(x.split(sizes), w1.unbind(0), w3.unbind(0), w2.unbind(0), strict=True)
    outputs = [linear(F.silu(linear(rows, gate)) * linear(rows, up), down) for rows, gate, up, down in pieces]
    return torch.cat(outputs) if outputs else x.new_zeros(0, w2.shape[1])


_KERNEL_FUNCTIONS = {"grouped_mm": _grouped_swiglu, "padded": _padded_swiglu, "loop": _loop_swiglu}


@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype, dim: int, hidden: int) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward here, and agrees with ``bmm``.

    Probed once per (device type, dtype, sizes) with uneven groups, one of them empty, since
    some builds limit the dtypes, devices or alignments the kernel accepts. The outcome is
    announced once (rank 0's stderr and the run's event log): which kernel ``auto`` picked
    decides the MoE layer's speed, and a silent fallback would hide it.
    """
    works, why = _probe_verdict(device_type, dtype, dim, hidden)
    _announce(device_type, dtype, dim, hidden, "grouped_mm" if works else "padded", why)
    return works


def _announce(device_type: str, dtype: torch.dtype, dim: int, hidden: int, kernel: str, why: str) -> None:
    where = f"{device_type}, {str(dtype).removeprefix('torch.')}, dim {dim}, hidden {hidden}"
    record_event(
        "forge-moe/expert_kernel", kernel=kernel, device=device_type, dtype=str(dtype), dim=dim, hidden=hidden, why=why
    )
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(f"forge-moe: expert kernel for {where}: {kernel} ({why})", file=sys.stderr, flush=True)


def _probe_verdict(device_type: str, dtype: torch.dtype, dim: int, hidden: int) -> tuple[bool, str]:
    if not hasattr(torch, "_grouped_mm"):
        return False, "this torch has no torch._grouped_mm"
    try:
        # The first call may come from inside a forward under activation checkpointing: identity
        # saved-tensor hooks keep the probe's own autograd graph out of the checkpoint's count,
        # and with the dispatch modes set aside selective checkpointing's cache never sees the
        # probe's products (its replay in backward would otherwise be handed them).
        with (
            _disable_current_modes(),
            torch.inference_mode(False),
            torch.enable_grad(),
            torch.autocast(device_type, enabled=False),
            torch.autograd.graph.saved_tensors_hooks(_identity, _identity),
        ):
            if _probe_grouped_mm(torch.device(device_type), dtype, dim, hidden):
                return True, "torch._grouped_mm"
            return False, "torch._grouped_mm disagreed with bmm here"
    except Exception as exc:  # noqa: BLE001 - any failure means: use the padded kernel
        return False, f"torch._grouped_mm failed here: {type(exc).__name__}"


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype, dim: int, hidden: int) -> bool:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(7, dim, generator=generator).to(device, dtype).requires_grad_()
    w = torch.randn(3, hidden, dim, generator=generator).to(device, dtype).requires_grad_()
    counts = torch.tensor([3, 0, 4], device=device)
    y = _grouped(x, w, counts.cumsum(0).to(torch.int32))
    y.sum().backward()
    expected = torch.cat([x[:3] @ w[0].T, x[3:] @ w[2].T])
    return bool(torch.allclose(y.float(), expected.float(), rtol=2e-2, atol=2e-2 * math.sqrt(dim)))


def _grouped_mm_traces(dtype: torch.dtype) -> bool:
    """Whether ``torch.compile`` can trace ``torch._grouped_mm`` in ``dtype``: its shape function
    (the meta kernel) accepts fewer dtypes than some eager kernels (bf16 only in torch 2.13,
    where the CPU kernel also runs fp32). Asked of the meta kernel itself, with no data."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    meta = torch.device("meta")
    try:
        torch._grouped_mm(
            torch.empty(4, 8, device=meta, dtype=dtype),
            torch.empty(2, 8, 8, device=meta, dtype=dtype),
            offs=torch.empty(2, device=meta, dtype=torch.int32),
        )
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


# Answered once, at import and outside any compiled region, for the dtypes layers run in: a
# compiled forward reads this table instead of probing (the probe runs a backward pass).
_TRACES_GROUPED_MM = {dtype: _grouped_mm_traces(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)}


def resolve_kernel(kernel: str, x: torch.Tensor, hidden: int) -> str:
    """``"auto"``: ``loop`` in fp32 on a CPU with oneDNN linear products (:func:`onednn_loop_chosen`),
    else ``grouped_mm`` where it works for ``x``'s device and dtype, else ``padded``.
    Inside ``torch.compile``: ``grouped_mm`` where the compiler can trace it for ``x``'s dtype."""
    if kernel != "auto":
        return kernel
    if torch.compiler.is_compiling():
        return "grouped_mm" if _TRACES_GROUPED_MM.get(x.dtype, False) else "padded"
    if x.device.type == "cpu" and x.dtype == torch.float32 and linear_kernel_in_use() == "onednn":
        return onednn_loop_chosen(x.shape[-1], hidden)
    return "grouped_mm" if grouped_mm_works(x.device.type, x.dtype, x.shape[-1], hidden) else "padded"


@functools.cache
def onednn_loop_chosen(dim: int, hidden: int) -> str:
    """``"loop"``, announced once per size: in fp32 on a CPU whose linear layers run on oneDNN,
    one oneDNN product per expert outruns ``torch._grouped_mm`` and ``bmm``, which take torch's
    BLAS (``benchmarks/bench_moe.py`` measures all three)."""
    why = "one oneDNN GEMM per expert, faster than grouped_mm in fp32 on CPU"
    _announce("cpu", torch.float32, dim, hidden, "loop", why)
    return "loop"


def expert_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    kernel: str = "auto",
    pad_to: int | None = None,
) -> torch.Tensor:
    """Each expert's SwiGLU on its rows: ``x`` ``[M, dim]`` holds ``counts[0]`` rows of expert 0,
    then ``counts[1]`` of expert 1, ...; returns ``[M, dim]``.

    Under autocast the rows and weights are cast to the autocast dtype (``torch._grouped_mm`` is
    not on autocast's lists). ``pad_to`` (the capacity, when there is one) fixes the padded
    kernel's buffer size, avoiding a device sync for the largest count.
    """
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, w1, w3, w2 = (t.to(dtype) for t in (x, w1, w3, w2))
    else:
        w1, w3, w2 = (t.to(x.dtype) for t in (w1, w3, w2))
    name = resolve_kernel(kernel, x, w1.shape[1])
    with torch.autocast(device_type, enabled=False):
        return _KERNEL_FUNCTIONS[name](x, counts, w1, w3, w2, pad_to)


# -- tokens to experts and back ------------------------------------------------------------------


def combine(y: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """Each token's output ``[tokens, dim]``: the sum over its kept assignments of the expert's
    output ``y`` (a row per kept slot, in the order of ``slots``, the flat ``token * top_k + k``
    positions) times its combine weight (``weights`` ``[tokens, top_k]``).

    One ``index_add`` of the weighted rows into the tokens' rows (its backward a gather), where
    scattering into a ``[tokens * top_k, dim]`` buffer and summing over ``top_k`` took about 3x
    as long on CPU (in ``benchmarks/bench_moe.py``'s layer, 0.10 of the layer's time against
    0.05 now). A token with no kept
    assignment stays zero. With top-2 the sums are exactly those in ``k`` order (``0 + a + b``
    equals ``0 + b + a`` in floating point); with more they follow the slots' order, by expert,
    deterministically on CPU (and on CUDA under ``torch.use_deterministic_algorithms``)."""
    weighted = y * weights.reshape(-1).index_select(0, slots).unsqueeze(-1).to(y.dtype)
    return y.new_zeros(tokens, y.shape[-1]).index_add(0, slots // top_k, weighted)


class RoutedTokens(NamedTuple):
    """How a layer's tokens reach the experts' rows and come back: the kept ``slots`` sorted by
    expert (:attr:`Dispatch.slots`; slot ``t * top_k + j`` is token ``t``'s ``j``-th choice) and
    the router's combine ``weights`` ``[tokens, top_k]``."""

    slots: torch.Tensor
    weights: torch.Tensor
    top_k: int


def routed_experts(
    tokens: torch.Tensor,
    counts: torch.Tensor,
    route: RoutedTokens,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    kernel: str = "auto",
    pad_to: int | None = None,
) -> torch.Tensor:
    """Each token's output ``[tokens, dim]``: the weighted sum of its kept experts' SwiGLU outputs.

    The token rows are gathered into expert order, run through :func:`expert_swiglu` and
    combined (:func:`combine`); where the kernel is the loop over experts outside autocast (fp32
    on CPU under ``auto``), the three run fused, one expert at a time (:class:`_RoutedLoop`):
    the same products and sums in the same order, bitwise the same results.
    """
    device_type = tokens.device.type
    fused = not torch.is_autocast_enabled(device_type) and tokens.dtype == w1.dtype == route.weights.dtype
    if fused and resolve_kernel(kernel, tokens, w1.shape[1]) == "loop":
        sizes = counts.tolist()  # a host read, as the loop's split sizes (free on the CPU)
        return _RoutedLoop.apply(tokens, route.weights, w1, w3, w2, route.slots, sizes, route.top_k)
    rows = tokens.index_select(0, route.slots // route.top_k)
    y = expert_swiglu(rows, counts, w1, w3, w2, kernel, pad_to=pad_to)
    return combine(y, route.weights, route.slots, tokens.shape[0], route.top_k)


class _RoutedLoop(torch.autograd.Function):
    """Gather, SwiGLU and combine, one expert at a time, forward and backward written out.

    Run as separate steps, the layer builds ``[tokens * top_k, dim]`` tensors (the gathered rows,
    the concatenated outputs, their weighted copy and, in backward, their gradients) and passes
    over each of them once more than it computes on them; on CPU those passes run at the speed of
    main memory, since every step's tensors outgrow the caches. Here each expert's few hundred
    rows are gathered, multiplied, weighted and added into the output while they are still in
    the cache, and the backward pass does the same per expert (``benchmarks/bench_moe.py``: the
    layer 11% to 12% faster, and it keeps fewer tensors for backward: each expert's two
    pre-activations and its output, plus the inputs). The products are Forge's linear products
    (:func:`forge_lm.model.linear.matmul_nt`); sums run in the unfused layer's order (a token's
    experts by expert index), so results are bitwise those of gather, loop and combine.
    """

    @staticmethod
    def forward(ctx, tokens, weights, w1, w3, w2, slots, sizes, top_k):
        sources, slot_weights = slots // top_k, weights.reshape(-1).index_select(0, slots)
        out = tokens.new_zeros(tokens.shape)
        kept, start = [], 0
        for expert, size in enumerate(sizes):
            if size == 0:  # nothing to save: the backward pass skips this expert too
                kept += [tokens.new_empty(0)] * 3
                continue
            stop = start + size
            rows = tokens.index_select(0, sources[start:stop])
            gate, up = matmul_nt(rows, w1[expert]), matmul_nt(rows, w3[expert])
            y = matmul_nt(F.silu(gate).mul_(up), w2[expert])
            out.index_add_(0, sources[start:stop], y * slot_weights[start:stop].unsqueeze(-1))
            kept += [gate, up, y]
            start = stop
        ctx.sizes, ctx.top_k = sizes, top_k
        ctx.save_for_backward(tokens, weights, w1, w3, w2, slots, *kept)
        return out

    @staticmethod
    def backward(ctx, grad):
        tokens, weights, w1, w3, w2, slots, *kept = ctx.saved_tensors
        need_tokens, need_weights = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        sources, slot_weights = slots // ctx.top_k, weights.reshape(-1).index_select(0, slots)
        grad_tokens = torch.zeros_like(tokens) if need_tokens else None
        # Dropped slots get no gradient, hence zeros; none at all when the weights need none.
        grad_slot_weights = weights.new_zeros(weights.numel()) if need_weights else None
        grads = [torch.empty_like(w) for w in (w1, w3, w2)]  # every expert's slice is written below
        start = 0
        for expert, size in enumerate(ctx.sizes):
            if size == 0:  # an expert without tokens: no gradient
                for weight_grad in grads:
                    weight_grad[expert].zero_()
                continue
            stop = start + size
            gate, up, y = kept[3 * expert : 3 * expert + 3]
            here = sources[start:stop]
            grad_y = grad.index_select(0, here)
            if need_weights:
                grad_slot_weights.index_copy_(0, slots[start:stop], (grad_y * y).sum(-1))
            grad_y.mul_(slot_weights[start:stop].unsqueeze(-1))  # now the gradient of y itself
            activated = F.silu(gate)
            grads[2][expert] = matmul_nt(grad_y.t(), (activated * up).t())
            grad_hidden = matmul_nt(grad_y, w2[expert].t())
            grad_up = grad_hidden * activated
            grad_gate = torch.ops.aten.silu_backward(grad_hidden.mul_(up), gate)
            rows = tokens.index_select(0, here)
            grads[0][expert] = matmul_nt(grad_gate.t(), rows.t())
            grads[1][expert] = matmul_nt(grad_up.t(), rows.t())
            if need_tokens:
                grad_rows = matmul_nt(grad_gate, w1[expert].t()).add_(matmul_nt(grad_up, w3[expert].t()))
                grad_tokens.index_add_(0, here, grad_rows)
            start = stop
        grad_weights = grad_slot_weights.view_as(weights) if need_weights else None
        return grad_tokens, grad_weights, *grads, None, None, None
