"""Attention layer contract: ``factory(options, spec: AttentionSpec, layer_index) -> nn.Module``
with ``forward(x, cos, sin, mask, is_causal, kv_cache)`` mapping ``[batch, seq, dim]`` to the
same shape.

The kit feeds the layer what Forge's transformer does: RoPE tables from
:func:`forge_lm.model.rope.rope_tables` (``rope_dim`` columns for a
:class:`~forge_lm.components.RotaryAttention`, else ``spec.head_dim``) and masks from
:func:`forge_lm.model.attention.attention_mask` (narrowed to ``window`` for a
:class:`~forge_lm.components.WindowedAttention`), in each form a CPU run passes: SDPA's
(``is_causal``, or a boolean mask) and eager attention's (a float ``0 / -inf`` bias). The layer
is initialised as a model initialises it, through :func:`forge_lm.model.init.initialize`.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import torch
from torch import nn

from forge_lm.components import AttentionSpec, RotaryAttention, TensorParallelizable, WindowedAttention
from forge_lm.testing._init import (
    check_meta_build_equals_the_plain_build,
    check_weights_depend_on_the_seed_only,
    initialised,
)
from forge_lm.testing._kit import Subject, category_check, skip_check

SPEC = AttentionSpec(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, n_layers=2, max_seq_len=64, rope_theta=10000.0)
SEQ, BATCH = 16, 2
LAYER_INDEX = 1  # not 0: a layer must store under its own index in a KV cache
BACKENDS = ("sdpa", "eager")  # the mask forms of a CPU run: SDPA's (None with is_causal, or boolean), eager's bias
DEPENDENCY_TOLERANCE = 1e-6  # relative to the output's largest magnitude: rounding, not attention
CACHE_TOLERANCE = 1e-5  # the same, for cached decoding against the full pass


def _spec(subject: Subject, backend: str = "sdpa") -> AttentionSpec:
    return attrs.evolve(subject.extras.get("spec", SPEC), backend=backend)


def _build(subject: Subject, spec: AttentionSpec, seed: int = 0, device: str | None = None) -> nn.Module:
    """The layer built (on ``device``; from the meta device given memory on the CPU) and
    initialised as a model does it: its ``init_weights(init)`` or the default rule."""
    return initialised(subject, lambda: subject.build(spec, LAYER_INDEX), seed, spec.n_layers, device)


def _window(layer: nn.Module) -> int | None:
    return int(layer.window) if isinstance(layer, WindowedAttention) else None


def _run(
    layer: nn.Module, x: torch.Tensor, spec: AttentionSpec, start: int = 0, kv_cache: object = None
) -> torch.Tensor:
    """The layer on ``x`` ``[B, T, dim]`` at positions ``[start, start + T)``, with the tables
    and mask the transformer would give it."""
    from forge_lm.model.attention import attention_mask
    from forge_lm.model.rope import rope_tables

    length = x.shape[1]
    rope_dim = int(layer.rope_dim) if isinstance(layer, RotaryAttention) else spec.head_dim
    cos, sin = rope_tables(rope_dim, start + length, spec.rope_theta)
    mask, is_causal = attention_mask(None, start, length, x.device, spec.backend, torch.float32, window=_window(layer))
    return layer(x, cos[start:], sin[start:], mask, is_causal, kv_cache)


def _input(spec: AttentionSpec, rows: int = BATCH, seed: int = 3) -> torch.Tensor:
    return torch.randn(rows, SEQ, spec.dim, generator=torch.Generator().manual_seed(seed))


def _backends(subject: Subject) -> Iterator[tuple[str, AttentionSpec]]:
    for backend in BACKENDS:
        yield f"with the {backend} backend's masks", _spec(subject, backend)


def _dependencies(layer: nn.Module, spec: AttentionSpec) -> torch.Tensor:
    """``[query, key]``: whether the output at position ``i`` changes when the input at position
    ``j`` does. Row ``j + 1`` of one batch is row 0 with position ``j`` changed."""
    base = _input(spec, rows=1)
    x = base.repeat(SEQ + 1, 1, 1)
    nudge = torch.randn(SEQ, spec.dim, generator=torch.Generator().manual_seed(5))
    x[torch.arange(1, SEQ + 1), torch.arange(SEQ)] += nudge
    with torch.no_grad():
        out = _run(layer.eval(), x, spec)
    tolerance = DEPENDENCY_TOLERANCE * max(1e-30, out.abs().max().item())
    return ((out[1:] - out[:1]).abs().amax(dim=-1) > tolerance).T  # [query i, changed position j]


@category_check("attentions")
def check_maps_hidden_states_to_the_same_shape(subject: Subject) -> None:
    for how, spec in _backends(subject):
        x = _input(spec)
        with torch.no_grad():
            y = _run(_build(subject, spec).eval(), x, spec)
        assert isinstance(y, torch.Tensor) and y.shape == x.shape, (
            f"{subject.label} {how} maps {tuple(x.shape)} to "
            f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}; the kit expects the same shape"
        )
        bad = int((~torch.isfinite(y)).sum())
        assert bad == 0, f"{subject.label} {how} returns {bad} non-finite values of {y.numel()}; the kit expects none"


@category_check("attentions")
def check_no_output_depends_on_a_later_position(subject: Subject) -> None:
    for how, spec in _backends(subject):
        seen = _dependencies(_build(subject, spec), spec)
        ahead = seen.triu(diagonal=1).nonzero().tolist()
        assert not ahead, (
            f"{subject.label} {how} looks ahead: the outputs at (query, later position) {ahead[:5]} change when the "
            f"input at the later position does ({len(ahead)} pairs); the kit expects no query to see a later key"
        )
        blind = (~seen.diagonal()).nonzero().flatten().tolist()
        assert not blind, (
            f"{subject.label} {how}: the outputs at positions {blind} do not change with their own input; the kit "
            "expects every query to see its own key"
        )


@category_check("attentions")
def check_query_sees_exactly_its_window_of_keys(subject: Subject) -> None:
    """Query ``i`` of a windowed layer sees key ``j`` iff ``i - window < j <= i``: the model's
    window-aware mask (``attention_mask(..., window=W)``) and whatever the layer does itself."""
    layer = _build(subject, _spec(subject))
    window = _window(layer)
    if window is None:
        skip_check(f"{subject.label} has no window: it is not a WindowedAttention")
    if subject.has_option("window"):
        wanted = subject.options().window
        assert window == wanted, (
            f"{subject.label} declares window = {window} but its options say window = {wanted}; the kit expects the "
            "layer's window to be the configured one"
        )
    if window >= SEQ:
        skip_check(
            f"{subject.label}'s window of {window} keys hides nothing in the kit's {SEQ}-token sequences; "
            "give it options={'window': 4} to check it"
        )
    query, key = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    expected = (key <= query) & (query - key < window)
    for how, spec in _backends(subject):
        seen = _dependencies(_build(subject, spec), spec)
        hidden, extra = (expected & ~seen).nonzero().tolist(), (seen & ~expected).nonzero().tolist()
        assert not hidden and not extra, (
            f"{subject.label} {how}, window = {window}: query i must see exactly keys i - {window - 1} to i; "
            f"it misses (query, key) {hidden[:5]} and sees {extra[:5]} beyond them ({len(hidden)} and {len(extra)} "
            "pairs); the kit expects neither"
        )


@category_check("attentions")
def check_forward_is_deterministic_in_eval_mode(subject: Subject) -> None:
    spec = _spec(subject)
    layer, x = _build(subject, spec).eval(), _input(spec)
    with torch.no_grad():
        first, again = _run(layer, x, spec), _run(layer, x, spec)
    gap = (first - again).abs().nan_to_num(float("inf")).max().item()
    assert torch.equal(first, again), (
        f"{subject.label}: in eval mode two passes over the same input give outputs up to {gap:.3g} apart; the kit "
        "expects identical outputs (dropout or other randomness left on outside training?)"
    )


@category_check("attentions")
def check_initial_weights_depend_on_the_seed_only(subject: Subject) -> None:
    spec = _spec(subject)
    check_weights_depend_on_the_seed_only(subject, lambda: subject.build(spec, LAYER_INDEX), spec.n_layers)


@category_check("attentions")
def check_meta_build_initialises_to_the_plain_build(subject: Subject) -> None:
    """Built on the meta device, given memory and initialised (what a sharded run does), the
    layer equals the one built in memory: values set in the constructor do not survive."""
    spec = _spec(subject)
    check_meta_build_equals_the_plain_build(subject, lambda: subject.build(spec, LAYER_INDEX), spec.n_layers)


@category_check("attentions")
def check_every_parameter_gets_a_gradient(subject: Subject) -> None:
    spec = _spec(subject)
    layer = _build(subject, spec).train()
    x = _input(spec).requires_grad_()
    _run(layer, x, spec).square().mean().backward()
    reached = 0.0 if x.grad is None else x.grad.abs().sum().item()
    assert reached > 0, (
        f"{subject.label} passes no gradient to its input (total magnitude {reached}); the kit expects a non-zero one"
    )
    trainable = [(name, p) for name, p in layer.named_parameters() if p.requires_grad]
    missing = [name for name, p in trainable if p.grad is None]
    assert not missing, (
        f"{subject.label}: {len(missing)} of {len(trainable)} trainable parameters receive no gradient: {missing}; "
        "the kit expects every trainable parameter to get one"
    )
    bad = [name for name, p in trainable if not torch.isfinite(p.grad).all()]
    assert not bad, f"{subject.label}: parameters {bad} get non-finite gradients; the kit expects finite ones"


@category_check("attentions")
def check_cached_decoding_matches_the_full_pass(subject: Subject) -> None:
    """Prefill half the sequence into a :class:`forge_lm.model.KVCache`, then one position at
    a time (the model calls ``advance`` after its layers): the outputs of the full pass."""
    from forge_lm.model.kv_cache import KVCache

    prefill = SEQ // 2
    for how, spec in _backends(subject):
        layer, x = _build(subject, spec).eval(), _input(spec)
        cache = KVCache(SEQ)
        with torch.no_grad():
            full = _run(layer, x, spec)
            steps = [_run(layer, x[:, :prefill], spec, kv_cache=cache)]
            cache.advance(prefill)
            for t in range(prefill, SEQ):
                steps.append(_run(layer, x[:, t : t + 1], spec, start=t, kv_cache=cache))
                cache.advance(1)
        decoded = torch.cat(steps, dim=1)
        tolerance = CACHE_TOLERANCE * max(1.0, full.abs().max().item())
        gaps = (decoded - full).abs().amax(dim=(0, 2))  # per position
        assert gaps.max().item() <= tolerance, (
            f"{subject.label} {how}: with a KV cache (prefill of {prefill} positions, then one at a time) the outputs "
            f"at positions {(gaps > tolerance).nonzero().flatten().tolist()} differ from the full pass's by up to "
            f"{gaps.max().item():.3g}; the kit expects them equal within {tolerance:.3g}"
        )


@category_check("attentions")
def check_the_capabilities_it_claims_are_well_formed(subject: Subject) -> None:
    """A positive window, an even RoPE width (pairs turn together), a tensor-parallel plan naming
    submodules."""
    layer = _build(subject, _spec(subject))
    if isinstance(layer, WindowedAttention):
        window = layer.window
        assert isinstance(window, int) and window > 0, (
            f"{subject.label}: window is {window!r}; the kit expects a positive int (keys a query sees)"
        )
    if isinstance(layer, RotaryAttention):
        rope_dim = layer.rope_dim
        assert isinstance(rope_dim, int) and rope_dim > 0 and rope_dim % 2 == 0, (
            f"{subject.label}: rope_dim is {rope_dim!r}; the kit expects a positive even int (RoPE turns pairs)"
        )
    if isinstance(layer, TensorParallelizable):
        plan = layer.tensor_parallel_plan()
        names = {name for name, _ in layer.named_modules()}
        missing = sorted(name for name in plan if name not in names) if isinstance(plan, dict) else None
        assert isinstance(plan, dict) and plan and not missing, (
            f"{subject.label}: tensor_parallel_plan() returned {plan!r}; the kit expects a non-empty "
            f"{{submodule name: ParallelStyle}} dict naming submodules of the layer ({sorted(n for n in names if n)})"
        )
