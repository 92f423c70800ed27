"""MoE layer forward+backward throughput: packed experts against a loop over experts and a dense layer.

One MoE layer (8 experts, top-2, dropless, softmax router) runs forward and backward on the same
batch with each expert kernel of forge-moe (``grouped_mm``: ``torch._grouped_mm``; ``padded``:
a padded batched matmul; ``loop``: one matmul per expert), with the same weights; beside it a
dense SwiGLU layer of the same active size (hidden = top_k * expert hidden), and the two routers
alone (forward + backward of their combine weights and losses). In fp32 and in bf16 (CPU
autocast, fp32 weights, as training runs). The variants alternate round by round after warm-up
rounds so drifting machine load hits them alike; medians are reported, with tokens/s, the
speed relative to the dense layer and to the expert loop, and time relative to the grouped MoE
layer (the routers' share of it). In fp32 also a fine-grained layer of the same active size
(4x the experts at a quarter of the width, top-8), where a loop pays for 32 small matmuls.

Where the MoE layer's time goes beyond the dense layer's: its parts alone (router, permutation,
experts, combine), and the linear products alone, for both layers (the dense layer's nine, the
experts' nine per expert at this routing's row counts), at each width. From these the headline
estimates the best ratio within reach: the layer's if permutation and combine cost nothing and
its other work beyond the products cost what the dense layer's does, plus the router. Parts
measured alone are as noisy as the layers (one run's layer measured above that estimate).

Run:  .venv/bin/python benchmarks/bench_moe.py [--rounds 10] [--threads N]

On a machine shared with other jobs, ``--threads 1`` keeps the numbers meaningful: with every
core busy, multi-threaded matmuls spend their time waiting at thread barriers, and kernels that
issue many small matmuls (one per expert) suffer most.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
from _record import alternate, median, save, timed

from forge_lm.model.linear import matmul_nt
from forge_lm.model.swiglu import SwiGLU
from forge_lm.train.cpu_memory import keep_freed_memory
from forge_moe.experts import Dispatch, dispatch, resolve_kernel
from forge_moe.layer import MoELayer
from forge_moe.layer import combine as combine_outputs
from forge_moe.routers import SigmoidTopKRouter, SoftmaxTopKRouter

DIM, N_EXPERTS, TOP_K, EXPERT_HIDDEN = 256, 8, 2, 256
BATCH, SEQ = 4, 512
DENSE = "dense swiglu (same active size)"
LOOP = "moe loop over experts"
AUTO = "moe auto (as forge-moe picks)"
PARTS = (
    "part: routing (softmax_topk router)",
    "part: permutation (dispatch + gather rows)",
    "part: experts alone (auto kernel)",
    "part: combine (weight + index_add)",
)
# The linear products alone, forward and backward, on the kernel both layers use.
DENSE_PRODUCTS = "products alone: dense layer's"
EXPERT_PRODUCTS = "products alone: the experts' (this routing's rows)"
GROUPED = "moe grouped_mm"
FINE_GROUPED = "fine-grained moe grouped_mm"
FINE_LOOP = "fine-grained moe loop over experts"
FINE_AUTO = "fine-grained moe auto"
# The default layer at 2x and 4x the width (dim and expert hidden): where the fixed costs stand
# as the products grow 4x and 16x.
WIDTHS = (2, 4)


def wide_dense(width: int) -> str:
    return f"dense swiglu, {width}x wide"


def wide_auto(width: int) -> str:
    return f"moe auto, {width}x wide"


def at_width(what: str, width: int) -> str:
    """The row ``what`` at ``width`` times the default width (1: the default's own name)."""
    return what if width == 1 else f"{what}, {width}x wide"


DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def moe_layer(
    kernel: str,
    capacity_factor: float | None = None,
    n_experts: int = N_EXPERTS,
    top_k: int = TOP_K,
    hidden: int = EXPERT_HIDDEN,
    dim: int = DIM,
) -> MoELayer:
    torch.manual_seed(0)  # every kernel gets the same weights and so the same routing
    router = SoftmaxTopKRouter(dim, n_experts, top_k, balance_loss_weight=0.01)
    return MoELayer(
        dim,
        0,
        router,
        n_experts=n_experts,
        top_k=top_k,
        expert_hidden=hidden,
        capacity_factor=capacity_factor,
        kernel=kernel,
    ).train()


def steady(sample: Callable[[], float], min_seconds: float = 0.1) -> Callable[[], float]:
    """``sample`` (the seconds of one call) run enough times per sample to last ``min_seconds``,
    returning the mean seconds of one call. The number of calls is fixed by the first sample
    (a warm-up one). One 20 ms call is at the mercy of a single scheduler hiccup on a shared
    machine; without this, a layer's parts measured alone could add up to more than the layer."""
    calls = 0

    def run() -> float:
        nonlocal calls
        if not calls:
            first = sample()
            calls = max(1, math.ceil(min_seconds / max(first, 1e-9)))
            return first
        return sum(sample() for _ in range(calls)) / calls

    return run


def layer_step(layer: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> Callable[[], float]:
    def step() -> None:
        layer.zero_grad(set_to_none=True)
        # The input needs its gradient, as every layer's does in a model (the products for it count).
        leaf = x.detach().requires_grad_()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            y = layer(leaf)
        y.float().square().mean().backward()

    return lambda: timed(step)


def router_step(router: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> Callable[[], float]:
    def step() -> None:
        router.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            routing = router(leaf)
        (routing.weights.square().mean() + sum(routing.aux_losses.values())).backward()

    return lambda: timed(step)


def auto_routing(x: torch.Tensor) -> tuple[MoELayer, Any, Dispatch]:
    """The fp32 auto layer, its routing of ``x`` and the dropless dispatch of that routing (the
    same every call: :func:`moe_layer` seeds the weights)."""
    layer = moe_layer("auto")
    with torch.no_grad():
        routing = layer.router(x)
        return layer, routing, dispatch(routing.indices, N_EXPERTS)


def breakdown_steps(x: torch.Tensor) -> dict[str, Callable[[], float]]:
    """The MoE layer's parts, each forward and backward alone on the inputs the layer would give
    it (fp32, dropless, the routing of the grouped layer's weights): where the time beyond the
    experts' matmuls goes. Together they are the layer (up to the autograd glue between them)."""
    layer, routing, plan = auto_routing(x)
    tokens, top_k = BATCH * SEQ, TOP_K
    flat = x.reshape(tokens, DIM)
    source = plan.slots // top_k
    generator = torch.Generator().manual_seed(3)
    rows_grad = torch.randn(plan.slots.numel(), DIM, generator=generator)
    out_grad = torch.randn(tokens, DIM, generator=generator)
    rows_in = flat[source].clone()
    y_in = torch.randn(plan.slots.numel(), DIM, generator=generator)
    weights_in = routing.weights.detach().clone()

    def permute() -> None:  # sort by expert and gather each assignment's token row
        leaf = flat.detach().requires_grad_()
        order = dispatch(routing.indices, N_EXPERTS)
        leaf.index_select(0, order.slots // top_k).backward(rows_grad)

    def experts() -> None:  # the experts' SwiGLU on their rows, as auto runs it
        rows = rows_in.detach().requires_grad_()
        layer.experts.zero_grad(set_to_none=True)
        layer.experts(rows, plan.counts, layer.kernel, None).backward(rows_grad)

    def combine() -> None:  # weight each expert output and sum a token's top-k back together
        y = y_in.detach().requires_grad_()
        weights = weights_in.detach().requires_grad_()
        combine_outputs(y, weights, plan.slots, tokens, top_k).backward(out_grad)

    steps = (router_step(layer.router, x, None), lambda: timed(permute), lambda: timed(experts), lambda: timed(combine))
    return dict(zip(PARTS, steps, strict=True))


def product_steps(layer: MoELayer, x: torch.Tensor, width: int) -> dict[str, Callable[[], float]]:
    """The linear products alone at ``width``: the experts' at ``layer``'s dropless routing of
    ``x``, and those of the dense layer of equal active size."""
    with torch.no_grad():
        rows = dispatch(layer.router(x).indices, N_EXPERTS).counts.tolist()
    dim, hidden = width * DIM, width * EXPERT_HIDDEN
    experts = [swiglu_products(count, dim, hidden) for count in rows if count]
    dense = swiglu_products(BATCH * SEQ, dim, TOP_K * hidden)
    return {
        at_width(EXPERT_PRODUCTS, width): lambda: timed(lambda: [run() for run in experts]),
        at_width(DENSE_PRODUCTS, width): lambda: timed(dense),
    }


def swiglu_products(rows: int, dim: int, hidden: int) -> Callable[[], None]:
    """The nine linear products of a SwiGLU layer's forward and backward over ``rows`` rows, and
    nothing else, through Forge's products (:func:`forge_lm.model.linear.matmul_nt`, the kernel
    both the dense layer and forge-moe's fused expert loop take), with the operands' layouts
    those layers pass (transposed views for the weight gradients)."""
    generator = torch.Generator().manual_seed(5)
    x, out_grad = torch.randn(rows, dim, generator=generator), torch.randn(rows, dim, generator=generator)
    activated, hidden_grad = (torch.randn(rows, hidden, generator=generator) for _ in range(2))
    gate, up = (torch.randn(hidden, dim, generator=generator) for _ in range(2))
    down = torch.randn(dim, hidden, generator=generator)

    def run() -> None:
        matmul_nt(x, gate), matmul_nt(x, up), matmul_nt(activated, down)  # forward
        matmul_nt(out_grad.t(), activated.t()), matmul_nt(out_grad, down.t())  # down: weight, input gradients
        matmul_nt(hidden_grad.t(), x.t()), matmul_nt(hidden_grad.t(), x.t())  # gate, up: weight gradients
        matmul_nt(hidden_grad, gate.t()), matmul_nt(hidden_grad, up.t())  # gate, up: input gradients

    return run


def variants(x: torch.Tensor) -> dict[tuple[str, str], Callable[[], float]]:
    torch.manual_seed(1)
    dense = SwiGLU(DIM, TOP_K * EXPERT_HIDDEN)
    routers = {
        "router softmax_topk": SoftmaxTopKRouter(DIM, N_EXPERTS, TOP_K, balance_loss_weight=0.01, z_loss_weight=1e-3),
        "router sigmoid_topk": SigmoidTopKRouter(DIM, N_EXPERTS, TOP_K, sequence_balance_loss_weight=1e-3),
    }
    out = {}
    for dtype_name, dtype in DTYPES.items():
        out[(dtype_name, DENSE)] = layer_step(dense, x, dtype)
        out[(dtype_name, GROUPED)] = layer_step(moe_layer("grouped_mm"), x, dtype)
        out[(dtype_name, "moe grouped_mm, capacity 1.25")] = layer_step(moe_layer("grouped_mm", 1.25), x, dtype)
        out[(dtype_name, "moe padded bmm")] = layer_step(moe_layer("padded"), x, dtype)
        out[(dtype_name, LOOP)] = layer_step(moe_layer("loop"), x, dtype)
        out[(dtype_name, AUTO)] = layer_step(moe_layer("auto"), x, dtype)
        for name, router in routers.items():
            out[(dtype_name, name)] = router_step(router.train(), x, dtype)
    # Fine-grained experts, same active size: 32 experts of a quarter the hidden size, top-8 (fp32 only).
    fine = {"n_experts": 4 * N_EXPERTS, "top_k": 4 * TOP_K, "hidden": EXPERT_HIDDEN // 4}
    fine_kernels = {
        "grouped_mm": FINE_GROUPED,
        "padded": "fine-grained moe padded bmm",
        "loop": FINE_LOOP,
        "auto": FINE_AUTO,
    }
    for kernel, what in fine_kernels.items():
        out[("fp32", what)] = layer_step(moe_layer(kernel, **fine), x, None)
    for width in WIDTHS:
        wide = torch.randn(BATCH, SEQ, width * DIM, generator=torch.Generator().manual_seed(4))
        torch.manual_seed(1)
        dense_wide = SwiGLU(width * DIM, TOP_K * width * EXPERT_HIDDEN)
        out[("fp32", wide_dense(width))] = layer_step(dense_wide, wide, None)
        moe_wide = moe_layer("auto", hidden=width * EXPERT_HIDDEN, dim=width * DIM)
        out[("fp32", wide_auto(width))] = layer_step(moe_wide, wide, None)
        out[("fp32", at_width(PARTS[0], width))] = router_step(moe_wide.router, wide, None)
        out.update({("fp32", what): step for what, step in product_steps(moe_wide, wide, width).items()})
    for what, step in breakdown_steps(x).items():
        out[("fp32", what)] = step
    out.update({("fp32", what): step for what, step in product_steps(moe_layer("auto"), x, 1).items()})
    return out


def within_reach_rows(medians: dict[tuple[str, str], float], width: int) -> list[dict[str, Any]]:
    """Headline rows at ``width``: the products alone, dense's over the experts', and the best
    layer ratio they leave within reach (an estimate; see the module's docstring)."""
    dense = medians[("fp32", DENSE if width == 1 else wide_dense(width))]
    dense_products = medians[("fp32", at_width(DENSE_PRODUCTS, width))]
    expert_products = medians[("fp32", at_width(EXPERT_PRODUCTS, width))]
    router = medians[("fp32", at_width(PARTS[0], width))]
    where = "" if width == 1 else f" at {width}x the width"
    rest = dense - dense_products
    return [
        {
            "measure": f"MoE layer fp32{where}, the linear products alone: the dense layer's / the experts' (time)",
            "value": dense_products / expert_products,
            "meaning": "the same nine products per expert, at this routing's rows, against the dense layer's nine; "
            "below 0.9, the products alone rule out the target",
        },
        {
            "measure": f"MoE layer fp32{where} (auto kernel): best dense / MoE within reach, estimated (time)",
            "value": dense / (expert_products + max(0.0, rest) + router),
            "meaning": "the layer's ratio if permutation and combine cost nothing and its rest beyond the products "
            "cost what the dense layer's does (the same SwiGLU elementwise work), plus the router alone: dense "
            f"{dense * 1e3:.1f} ms over (products {expert_products * 1e3:.1f} + dense's rest {rest * 1e3:.1f} + "
            f"router {router * 1e3:.1f})",
        },
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # As in a Forge run on CPU: freed memory stays in the process, so no layer pays for faulting
    # its activations in afresh each step (with glibc's defaults the dense layer's larger
    # tensors did, and the MoE layer's smaller ones less, which flattered the MoE layer).
    cpu_memory = keep_freed_memory()

    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(2))
    steps = {key: steady(step) for key, step in variants(x).items()}
    names = {f"{dtype} {what}": (dtype, what) for dtype, what in steps}
    samples = alternate({name: steps[key] for name, key in names.items()}, args.rounds, args.warmup)
    medians = {names[name]: median(values) for name, values in samples.items()}

    tokens = BATCH * SEQ
    rows = []
    for name, values in samples.items():
        dtype_name, what = names[name]
        time_s = medians[(dtype_name, what)]
        fine = what.startswith("fine-grained")
        width = next((w for w in WIDTHS if what.endswith(f"{w}x wide")), None)
        wide = width is not None
        dense = medians[(dtype_name, wide_dense(width) if wide else DENSE)]
        loop = medians[(dtype_name, wide_auto(width) if wide else FINE_LOOP if fine else LOOP)]
        rows.append(
            {
                "dtype": dtype_name,
                "what (forward + backward)": what,
                "median_ms": time_s * 1000,
                "min_ms": min(values) * 1000,
                "tokens_per_s": tokens / time_s,
                "speed_vs_dense": dense / time_s,
                "speed_vs_loop": loop / time_s,
                "time_vs_moe_grouped": None
                if wide
                else time_s / medians[(dtype_name, FINE_GROUPED if fine else GROUPED)],
            }
        )
        print(
            f"{name:42s} {time_s * 1000:8.2f} ms  {tokens / time_s:9.0f} tok/s  "
            f"x{dense / time_s:.2f} dense  x{loop / time_s:.2f} loop"
        )
    headline = []
    for dtype_name in DTYPES:
        grouped = medians[(dtype_name, GROUPED)]
        headline += [
            {
                "measure": f"MoE layer {dtype_name}: expert loop / grouped_mm (time)",
                "value": medians[(dtype_name, LOOP)] / grouped,
                "meaning": "above 1: packed experts beat the loop over experts",
            },
            {
                "measure": f"MoE layer {dtype_name}: dense of equal active size / grouped_mm (time)",
                "value": medians[(dtype_name, DENSE)] / grouped,
                "meaning": "1 would be a dropless MoE layer as fast as its dense equivalent",
            },
        ]
    auto = medians[("fp32", AUTO)]
    parts = {what: medians[("fp32", what)] for what in PARTS}
    headline.append(
        {
            "measure": "MoE layer fp32 as forge-moe runs it (auto kernel): dense of equal active size / MoE (time)",
            "value": medians[("fp32", DENSE)] / auto,
            "meaning": "target 0.9; the parts, each run alone, as shares of the layer (which runs permutation, "
            "experts and combine fused): "
            + ", ".join(f"{what.removeprefix('part: ')} {value / auto:.2f}" for what, value in parts.items()),
        }
    )
    for width in (1, *WIDTHS):
        headline += within_reach_rows(medians, width)
    fine_loop = medians[("fp32", FINE_LOOP)] / medians[("fp32", FINE_GROUPED)]
    headline += [
        {
            "measure": f"MoE layer fp32, {4 * N_EXPERTS} fine-grained experts: loop / grouped_mm (time)",
            "value": fine_loop,
            "meaning": "above 1: packed experts beat the loop over experts",
        },
        {
            "measure": f"MoE layer fp32, {4 * N_EXPERTS} fine-grained experts top-{4 * TOP_K} (auto kernel): dense of "
            "equal active size / MoE (time)",
            "value": medians[("fp32", DENSE)] / medians[("fp32", FINE_AUTO)],
            "meaning": f"target 0.9; {4 * N_EXPERTS * 9} small products per step (experts of hidden "
            f"{EXPERT_HIDDEN // 4})",
        },
    ]
    headline += [
        {
            "measure": f"MoE layer fp32 at {width}x the width (auto kernel): dense of equal active size / MoE (time)",
            "value": medians[("fp32", wide_dense(width))] / medians[("fp32", wide_auto(width))],
            "meaning": f"the same ratio with {width * width}x the products' work: how much of the gap is fixed cost",
        }
        for width in WIDTHS
    ]
    save(
        "moe",
        f"python benchmarks/bench_moe.py --rounds {args.rounds}"
        + (f" --threads {args.threads}" if args.threads else ""),
        rows,
        notes=(
            f"One MoE layer: dim {DIM}, {N_EXPERTS} experts of hidden {EXPERT_HIDDEN}, top-{TOP_K}, softmax router, "
            f"dropless unless stated; {tokens} tokens ({BATCH} x {SEQ}) per step, training mode. Dense: SwiGLU of "
            f"hidden {TOP_K * EXPERT_HIDDEN} (the MoE layer's active size without the router). bf16: CPU autocast "
            f"over fp32 weights. Medians of {args.rounds} alternating rounds after {args.warmup} warm-up rounds, "
            "each sample the mean of as many calls as last 0.1 s (at least one); "
            "speed_vs_*: that layer's median time over this row's (higher is faster); time_vs_moe_grouped: this "
            "row's median over the grouped MoE layer's (the routers' share of the layer). Fine-grained rows: "
            f"{4 * N_EXPERTS} experts of hidden {EXPERT_HIDDEN // 4}, top-{4 * TOP_K}, compared with their own loop. "
            "Wide rows: "
            + ", ".join(f"{w}x dim {w * DIM} with experts of hidden {w * EXPERT_HIDDEN}" for w in WIDTHS)
            + ", each against a dense layer of that width. "
            "Every layer's input needs its gradient, as in a model. "
            f"Freed memory kept in the process, as a Forge run on CPU does (forge_lm.train.cpu_memory: {cpu_memory}). "
            "The loop over experts in fp32 (and so auto's layer here) runs gather, experts and combine fused, one "
            "expert at a time (forge_moe.experts.routed_experts). "
            "Linear products: the core's default (fp32 on CPU: oneDNN, forge_lm.model.linear), in the dense layer and "
            "the loop over experts alike; grouped_mm and bmm use torch's own kernels. `auto`: the kernel forge-moe "
            f"picks here ({resolve_kernel('auto', x.reshape(-1, DIM), EXPERT_HIDDEN)} in fp32). `part:` rows: the "
            "auto layer's parts, each forward and backward alone on the inputs the layer gives it (fp32, dropless), "
            "time_vs_moe_grouped over the grouped layer's time; the headline gives them as shares of the auto layer."
        ),
        headline=headline,
    )


if __name__ == "__main__":
    main()
