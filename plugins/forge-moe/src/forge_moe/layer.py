"""The ``moe`` feed-forward component: a mixture-of-experts layer every n-th block, SwiGLU elsewhere.

One MoE layer: the router picks ``top_k`` of ``n_experts`` SwiGLU experts per token and their
combine weights; :func:`forge_moe.experts.dispatch` sorts the assignments by expert (dropping
those beyond the capacity, in training); the experts run packed
(:func:`forge_moe.experts.expert_swiglu`); each token's output is the weighted sum over its kept
assignments, plus its shared experts. Under expert parallelism
(:mod:`forge_moe.expert_parallel`) the sorted assignments travel to the ranks that own their
experts and back. Shared experts: ``n_shared_experts = N`` is one SwiGLU of ``N * expert
hidden`` width, which is exactly the sum of ``N`` separate expert-sized SwiGLUs (their hidden
units concatenated), so parameters, FLOPs and outputs are those of ``N`` experts.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from forge_lm.api import (
    COMPONENT_ATTRIBUTE,
    ComponentFailed,
    SwiGLU,
    mark_component,
    report_aux_loss,
    report_metric,
    swiglu_hidden,
)
from forge_lm.errors import PluginError
from forge_moe.experts import RoutedTokens, capacity, combine, dispatch, expert_swiglu, routed_experts
from forge_moe.routers import Routing, recomputing

if TYPE_CHECKING:
    from forge_lm.components import Initializer


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts as stacked weights, ``nn.Linear`` layout per expert."""

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # down: writes into the residual stream
        for weight in (self.w1, self.w3, self.w2):  # a standalone default; a model's build sets them by init_weights
            nn.init.normal_(weight, mean=0.0, std=0.02)

    def init_weights(self, init: Initializer) -> None:
        """Gate and up ``normal(0, init.std)``, down ``normal(0, init.residual_std)``. Under expert
        parallelism the weights are DTensors holding this rank's experts; ``init`` fills exactly
        those with the values the one-process experts get (each value depends on the seed and
        the parameter's name, not on which rank holds it)."""
        init.normal(self.w1, init.std)
        init.normal(self.w3, init.std)
        init.normal(self.w2, init.residual_std)

    def per_expert_parameters(self) -> int:
        return sum(w.shape[1] * w.shape[2] for w in (self.w1, self.w3, self.w2))  # global shapes under EP

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor, kernel: str, pad_to: int | None, route: RoutedTokens | None = None
    ) -> torch.Tensor:
        """:func:`forge_moe.experts.expert_swiglu` of the experts this module holds: all of them, or
        this rank's slice under expert parallelism (its weights are then DTensors on the ``ep``
        mesh); ``x`` holds the experts' rows, in expert order. With ``route``, ``x`` holds the
        layer's tokens instead, and the result is each token's combined output
        (:func:`forge_moe.experts.routed_experts`). Called as a module so that FSDP2 gathers the
        weights around it."""
        w1, w3, w2 = (_local(w) for w in (self.w1, self.w3, self.w2))
        if route is not None:
            return routed_experts(x, counts, route, w1, w3, w2, kernel, pad_to=pad_to)
        return expert_swiglu(x, counts, w1, w3, w2, kernel, pad_to=pad_to)


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight  # a DTensor: this rank's experts


@torch.compiler.disable
def _report(prefix: str, losses: dict[str, torch.Tensor], statistics: dict[str, torch.Tensor]) -> None:
    """Hand a forward's losses and statistics (device tensors) to the training loop's collector.

    Outside the compiled graph: the collector is found through a context variable, which
    torch.compile cannot trace. The graph ends here, once per MoE layer, and the computation
    after it (the block's residual add) is compiled separately. (Dynamo's reorderable logging
    functions would avoid the break, but in torch 2.13 it drops their calls made from
    inlined modules, which every call from a compiled block is.)"""
    for name, value in losses.items():
        report_aux_loss(f"{prefix}/{name}", value)
    for name, value in statistics.items():
        report_metric(f"{prefix}/{name}", value)


class MoELayer(nn.Module):
    """``[batch, seq, dim] -> [batch, seq, dim]``; see the module docstring.

    Reports, inside the training loop's collector, the router's weighted losses as
    ``moe/layer<i>/<name>`` and, in training mode, the routing statistics
    ``moe/layer<i>/load_min``, ``load_max`` (an expert's assignments over the uniform share,
    1.0 = balanced), ``load_cv`` (std / mean of the assignments per expert) and
    ``drop_fraction`` (assignments dropped by the capacity limit over all assignments).

    The statistics cover every training forward since the last optimizer step (all the
    micro-batches of a step): the per-expert counts are summed on the device, in the buffers
    ``routed_load``, ``dropped_load`` and ``routed_slots``, and the statistics are reported as
    device tensors, which the training loop reads only on the steps it logs. Nothing in a
    forward waits for the device (expert parallelism's split sizes aside).
    """

    def __init__(
        self,
        dim: int,
        layer_index: int,
        router: nn.Module,
        *,
        n_experts: int,
        top_k: int,
        expert_hidden: int,
        n_shared_experts: int = 0,
        capacity_factor: float | None = None,
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        self.layer_index, self.n_experts, self.top_k = layer_index, n_experts, top_k
        self.capacity_factor, self.kernel = capacity_factor, kernel
        self.router = router
        self.experts = GroupedExperts(dim, expert_hidden, n_experts)
        self.shared = SwiGLU(dim, n_shared_experts * expert_hidden) if n_shared_experts else None
        # Set by forge-moe's transforms in distributed runs (forge_moe.expert_parallel): this
        # layer's expert-parallel group, and the data-parallel group its router's load is summed over.
        self.expert_parallel: Any = None
        self.load_group: Any = None
        # Routing counts since the last optimizer step (int64: exact at any batch size).
        self.register_buffer("routed_load", torch.zeros(n_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped_load", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("routed_slots", torch.zeros((), dtype=torch.int64), persistent=False)
        # Forwards whose routing broke the contract since the last check, per fault (_FAULTS).
        self.register_buffer("routing_faults", torch.zeros(len(_FAULTS), dtype=torch.int64), persistent=False)
        # A malformed routing found in a distributed run, raised after the step (see _checked).
        self.deferred_form_problem: str | None = None
        if self.shared is not None:  # the standalone default of an expert (a model's build sets it again)
            for linear in (self.shared.w1, self.shared.w3, self.shared.w2):
                nn.init.normal_(linear.weight, mean=0.0, std=0.02)

    def init_weights(self, init: Initializer) -> None:
        """The router by its own ``init_weights(init)`` (else every linear weight ``normal(0,
        init.std)``), the experts and the shared experts as SwiGLU layers (down projections
        ``init.residual_std``)."""
        init.module(self.router)
        self.experts.init_weights(init)
        if self.shared is not None:
            self.shared.init_weights(init)
        for counts in (self.routed_load, self.dropped_load, self.routed_slots, self.routing_faults):
            init.zeros(counts)

    def grow_source(self, source: Any, shapes: Any, rules: Any, generator: Any) -> dict[str, torch.Tensor]:
        """More experts than the source's (``[checkpoint.growth] experts``): :func:`forge_moe.growth.grow_experts`."""
        from forge_moe.growth import grow_experts

        return grow_experts(source, shapes, rules, generator)

    def active_parameter_count(self) -> int:
        """Per token: the whole router (it scores every expert), ``top_k`` experts, the shared experts."""
        count = sum(p.numel() for p in self.router.parameters())
        count += self.top_k * self.experts.per_expert_parameters()
        if self.shared is not None:
            count += sum(p.numel() for p in self.shared.parameters())
        return count

    def capacity(self, tokens: int) -> int | None:
        """The per-expert capacity for ``tokens`` tokens; None (no dropping) outside training."""
        if self.capacity_factor is None or not self.training:
            return None
        return capacity(self.capacity_factor, tokens, self.top_k, self.n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = batch * seq
        routing = self._checked(self.router(x), x)
        limit = self.capacity(tokens)
        plan = dispatch(routing.indices, self.n_experts, limit)
        flat = x.reshape(tokens, dim)
        if self.expert_parallel is None:  # gather, experts and combine in one call (fused where it pays)
            out = self.experts(
                flat, plan.counts, self.kernel, limit, RoutedTokens(plan.slots, routing.weights, self.top_k)
            )
        else:  # the rows to the experts' owners and back, then combined here
            # index_select rather than indexing: its backward pass is an index_add, where
            # indexing's is a scattered index_put (slow, serial on CPU).
            rows = flat.index_select(0, plan.slots // self.top_k)
            y = self.expert_parallel.run(self.experts, rows, plan.counts, self.kernel, limit)
            out = combine(y, routing.weights, plan.slots, tokens, self.top_k)
        if self.shared is not None:
            out = out + self.shared(flat).to(out.dtype)
        if not recomputing():  # activation checkpointing's replay has reported already
            statistics = self._statistics(plan.assigned, plan.dropped, tokens) if self.training else {}
            _report(f"moe/layer{self.layer_index}", routing.aux_losses, statistics)
        return out.view(batch, seq, dim)

    def _checked(self, routing: Any, x: torch.Tensor) -> Routing:
        """The router's result, if it keeps the contract (:mod:`forge_moe.routers`).

        Its form (types, shapes, dtypes: metadata) is checked here, a failure named at once
        in one process. Its values are checked on the device without waiting for it: experts
        outside ``0..n_experts-1``, an expert twice for one token, negative combine weights. A
        forward that finds one counts it in ``routing_faults``, uses expert 0 in place of an
        index out of range (no index error, no device assert) and makes every combine weight
        NaN, so that the step's loss is not finite: the training loop then asks
        :meth:`raise_device_findings`, which names the router. A step with good routing waits
        for nothing.

        In a distributed run a wrong form is not raised at once either: the other ranks are
        already on their way to the step's collectives (the next layer's all-gather, the
        gradients' reduction) and would wait there for this rank until the hang timeout. The
        forward goes on with a stand-in routing whose weights are NaN (:meth:`_stand_in`), and
        the finding is raised after the step, when every rank asks, agreed across the ranks
        (:meth:`forge_lm.train.guards.Guards.raise_device_findings`)."""
        tokens = x.shape[0] * x.shape[1]
        problem = self._form_problem(routing, tokens)
        if problem is not None:
            if not _distributed():
                self._router_failed(problem)
            if not recomputing() and self.deferred_form_problem is None:
                self.deferred_form_problem = problem
            return self._stand_in(x, tokens)
        indices, weights, losses = routing.indices, routing.weights, routing.aux_losses
        outside = (indices < 0) | (indices >= self.n_experts)
        twice = indices.new_zeros((), dtype=torch.bool)
        if self.top_k > 1:
            ordered = indices.sort(dim=-1).values
            twice = (ordered[:, 1:] == ordered[:, :-1]).any()
        faults = torch.stack([outside.any(), twice, (weights < 0).any()])
        if not recomputing():
            with torch.no_grad():
                self.routing_faults += faults
        poison = weights.new_full((), float("nan")).where(faults.any(), 0.0)
        return Routing(indices.masked_fill(outside, 0), weights + poison, losses)

    def _form_problem(self, routing: Any, tokens: int) -> str | None:
        """What is wrong with the form of the router's result (metadata only), or None."""
        indices, weights, losses = (getattr(routing, field, None) for field in ("indices", "weights", "aux_losses"))
        shape = [tokens, self.top_k]
        if not isinstance(indices, torch.Tensor) or not isinstance(weights, torch.Tensor):
            got = "None" if routing is None else f"a {type(routing).__name__}"
            return f"returned {got}; a router returns a Routing(indices, weights, aux_losses)"
        for name, tensor, kind in (("indices", indices, "int64"), ("weights", weights, "floating")):
            if list(tensor.shape) != shape or not (
                tensor.is_floating_point() if kind == "floating" else tensor.dtype == torch.int64
            ):
                dtype = str(tensor.dtype).removeprefix("torch.")
                return (
                    f"returned {name} of shape {list(tensor.shape)} and dtype {dtype}; a router returns {kind} "
                    f"{name} of shape [tokens, top_k] = {shape}"
                )
        bad = [value for value in losses.values() if not _scalar(value)] if isinstance(losses, dict) else [losses]
        if bad:
            got = (
                f"a tensor of shape {list(bad[0].shape)}"
                if isinstance(bad[0], torch.Tensor)
                else f"a {type(bad[0]).__name__}"
            )
            return f"returned {got} as an auxiliary loss; aux_losses is a dict of names to 0-d floating tensors"
        return None

    def _stand_in(self, x: torch.Tensor, tokens: int) -> Routing:
        """A routing of the right form in place of a malformed one: every token to expert 0
        with NaN weights. The NaN reaches every router parameter's gradient too, so that each
        parameter takes part in the backward as on the other ranks (a data-parallel reduction
        expects the same gradients from every rank) and the step is not finite everywhere."""
        anchor = sum((p.float().sum() for p in self.router.parameters()), x.new_zeros((), dtype=torch.float32))
        nan = anchor * float("nan")
        weights = x.new_zeros(tokens, self.top_k, dtype=torch.float32) + nan
        return Routing(torch.zeros(tokens, self.top_k, dtype=torch.int64, device=x.device), weights, {})

    def _router_failed(self, problem: str) -> NoReturn:
        component = getattr(self.router, COMPONENT_ATTRIBUTE, None)
        if component is None:  # a router built outside build_router: no registered component to name
            raise TypeError(f"the router of MoE layer {self.layer_index} {problem}")
        raise ComponentFailed(component, f"{problem} (MoE layer {self.layer_index})")

    def raise_device_findings(self) -> None:
        """After a non-finite step: name the router if a forward since the last call found a fault
        in its routing (:meth:`_checked`); forget the findings. Reads the counts (a host sync):
        called only after a bad step."""
        found = self.routing_faults.tolist()
        self.routing_faults.zero_()
        form, self.deferred_form_problem = self.deferred_form_problem, None
        if form is not None:
            self._router_failed(f"{form}; the step was not taken")
        faults = [f"{what} ({count} forwards)" for what, count in zip(_FAULTS, found, strict=True) if count]
        if faults:
            self._router_failed(f"returned {'; '.join(faults)}; the step was not taken")

    @torch.no_grad()
    def _statistics(self, assigned: torch.Tensor, dropped: torch.Tensor, tokens: int) -> dict[str, torch.Tensor]:
        """Add this forward's counts to the step's; the step's statistics so far, as device
        tensors (no sync: the training loop reads them on the steps it logs)."""
        self.routed_load += assigned
        self.dropped_load += dropped
        self.routed_slots += tokens * self.top_k
        slots = self.routed_slots.float()
        load = self.routed_load.float()
        share = load * self.n_experts / slots
        return {
            "load_min": share.min(),
            "load_max": share.max(),
            "load_cv": load.std(correction=0) / load.mean(),
            "drop_fraction": self.dropped_load.float() / slots,
        }

    @torch.no_grad()
    def _clear_statistics(self) -> None:
        for counts in (self.routed_load, self.dropped_load, self.routed_slots):
            counts.zero_()

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """The router's ``after_optimizer_step()``, if it has one. In data-parallel runs a router's
        ``pending_load`` buffer (its assignment counts since the last step) is first summed over
        the data-parallel ranks, so the update sees the global batch's load on every rank.
        The routing statistics start again from zero for the next step."""
        self._clear_statistics()
        hook = getattr(self.router, "after_optimizer_step", None)
        if not callable(hook):
            return
        pending = getattr(self.router, "pending_load", None)
        if self.load_group is not None and isinstance(pending, torch.Tensor):
            dist.all_reduce(pending, group=self.load_group)
        hook()

    @torch.no_grad()
    def step_skipped(self) -> None:
        """The router's ``step_skipped()``, if it has one: the abandoned step's per-step state is
        dropped (no all-reduce: every rank skips the same step and drops its own counts), and so
        are the layer's routing statistics."""
        self._clear_statistics()
        hook = getattr(self.router, "step_skipped", None)
        if callable(hook):
            hook()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim == 0 and value.is_floating_point()


_FAULTS = (
    "expert indices outside 0..n_experts-1",
    "the same expert more than once for a token",
    "negative combine weights",
)


# -- factory ------------------------------------------------------------------------------------


@functools.cache
def _registry() -> Any:
    from forge_lm.api import PluginManager

    return PluginManager().registry


def build_router(chosen: Any, dim: int, n_experts: int, top_k: int) -> nn.Module:
    """The router a ``ComponentConfig`` selects, with the routers' factory arguments.

    A config from the loader carries its resolved component; one built in code (the default
    ``ComponentConfig("softmax_topk")``) is resolved here through the installed plugins.
    """
    component = chosen.component if chosen.component is not None else _registry().resolve("routers", chosen.name)
    options = chosen.options if chosen.options is not None else component.options_class()
    router = component.build(options, dim, n_experts, top_k)
    if not isinstance(router, nn.Module):
        raise PluginError(
            f"router '{chosen.name}' returned {type(router).__name__}, not a torch.nn.Module; a router factory "
            "takes (options, dim, n_experts, top_k) and returns a module mapping [batch, seq, dim] to a Routing."
        )
    return mark_component(router, component)  # a failure in its forward, or in what it returns, names it


def expert_hidden(options: Any, dim: int) -> int:
    """An expert's hidden size: the dense SwiGLU rule with ``hidden_multiplier * expert_multiplier``."""
    return swiglu_hidden(dim, options.hidden_multiplier * options.expert_multiplier, options.multiple_of)


def build_moe(options: Any, dim: int, layer_index: int) -> nn.Module:
    """Factory of the ``moe`` feed-forward component (options: ``forge_moe.options.MoEOptions``)."""
    if not options.is_moe_layer(layer_index):
        return SwiGLU(dim, swiglu_hidden(dim, options.hidden_multiplier, options.multiple_of))
    return MoELayer(
        dim,
        layer_index,
        build_router(options.router, dim, options.n_experts, options.top_k),
        n_experts=options.n_experts,
        top_k=options.top_k,
        expert_hidden=expert_hidden(options, dim),
        n_shared_experts=options.n_shared_experts,
        capacity_factor=options.capacity_factor,
        kernel=options.expert_kernel,
    )


def after_optimizer_step(model: nn.Module) -> None:
    """:meth:`MoELayer.after_optimizer_step` of every MoE layer in ``model`` (its router's update)."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.after_optimizer_step()


def step_skipped(model: nn.Module) -> None:
    """:meth:`MoELayer.step_skipped` of every MoE layer in ``model`` (its router's pending state dropped)."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.step_skipped()
