"""Model family contract: ``factory(options, context: ModelContext) -> nn.Module``, a
:class:`forge_lm.components.LanguageModel` built through :func:`forge_lm.model.build_model`.

The kit builds the family from its options table (the family's defaults when none is given: a
family author passes ``options=`` to shrink it), on a vocabulary of :data:`VOCAB` tokens unless
the options set ``vocab_size``, and runs it on the CPU in fp32. Capability checks run only on a
model that declares the capability (:mod:`forge_lm.components`); they are skipped, with the
reason, on one that does not.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from forge_lm.components import (
    PARAMETER_ROLES,
    ContextParallelAttention,
    ContextParallelModel,
    CountsFlops,
    DecodesWithCache,
    GenerationLimits,
    parameter_roles,
)
from forge_lm.config import ComponentConfig
from forge_lm.errors import ForgeError
from forge_lm.testing._init import first_difference, named_tensors
from forge_lm.testing._kit import Subject, category_check, skip_check

VOCAB = 61  # small, and prime: no weight but the embedding and the head has a dimension of this size
SEQ, BATCH = 16, 2
FLOPS_SEQ = 64  # a longer sequence for the FLOP count, so attention's share of it is large
CAUSAL_TOLERANCE = 1e-6  # on logits, relative to their largest magnitude: rounding, not leakage
DOCUMENT_TOLERANCE = 1e-5  # the same, for a document alone against within a pack (RoPE at other positions)
CACHE_TOLERANCE = 1e-5  # the same, for cached decoding against the full forward
FLOPS_TOLERANCE = 0.01  # relative; see check_flops_per_token_matches_the_counted_matmuls
SEEDS = (1, 2)


def _config(subject: Subject) -> ComponentConfig:
    return ComponentConfig(subject.component.name, subject.options(), subject.component)


def _vocab(subject: Subject) -> int:
    return getattr(subject.options(), "vocab_size", None) or VOCAB


def _seq(model: nn.Module, wanted: int = SEQ) -> int:
    return min(wanted, int(model.config.max_seq_len))


def _build(subject: Subject, seed: int = 0, device: str | None = None) -> nn.Module:
    """The family built as a run builds it: :func:`build_model`, which also initialises it."""
    from forge_lm.model import build_model

    try:
        return build_model(_config(subject), _vocab(subject), subject.manager.registry, seed=seed, device=device)
    except ForgeError as exc:
        raise AssertionError(
            f"{subject.label} cannot be built by forge_lm.model.build_model: {str(exc).rstrip('.')}; the kit expects "
            "it built and initialised (every parameter and buffer set through the Initializer)"
        ) from exc


def _tokens(rows: int, seq: int, vocab: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _logits(subject: Subject, model: nn.Module, ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
    out = model(ids, **kwargs)
    assert isinstance(out, torch.Tensor), (
        f"{subject.label}: model(input_ids) returned {type(out).__name__}; the kit expects a logits tensor"
    )
    return out.float()


def _scale(logits: torch.Tensor) -> float:
    return max(1.0, logits.abs().max().item())


@category_check("models")
def check_gives_finite_logits_of_shape_batch_seq_vocab(subject: Subject) -> None:
    model = _build(subject).eval()
    vocab, seq = _vocab(subject), _seq(model)
    ids = _tokens(BATCH, seq, vocab)
    with torch.no_grad():
        logits = _logits(subject, model, ids)
    assert tuple(logits.shape) == (BATCH, seq, vocab), (
        f"{subject.label} maps input_ids of shape {(BATCH, seq)} to logits of shape {tuple(logits.shape)}; the kit "
        f"expects [batch, seq, vocab] = {(BATCH, seq, vocab)}"
    )
    bad = int((~torch.isfinite(logits)).sum())
    assert bad == 0, f"{subject.label} gives {bad} non-finite logits of {logits.numel()}; the kit expects none"


@category_check("models")
def check_no_logit_depends_on_a_later_token(subject: Subject) -> None:
    """Row ``t + 1`` of the batch is row 0 with the token at position ``t`` changed: its logits
    before ``t`` must be row 0's, and some at or after ``t`` must differ."""
    model = _build(subject).eval()
    vocab, seq = _vocab(subject), _seq(model)
    base = _tokens(1, seq, vocab)
    ids = base.repeat(seq + 1, 1)
    for t in range(seq):
        ids[t + 1, t] = (base[0, t] + 1) % vocab
    with torch.no_grad():
        logits = _logits(subject, model, ids)
    tolerance = CAUSAL_TOLERANCE * _scale(logits)
    gaps = (logits[1:] - logits[:1]).abs().amax(dim=-1)  # [changed position t, position]
    for t in range(seq):
        before = gaps[t, :t].max().item() if t else 0.0
        assert before <= tolerance, (
            f"{subject.label} looks ahead: changing the token at position {t} changes the logits at positions "
            f"{(gaps[t, :t] > tolerance).nonzero().flatten().tolist()} before it by up to {before:.3g}; the kit "
            f"expects no change there (within {tolerance:.3g})"
        )
        after = gaps[t, t:].max().item()
        assert after > tolerance, (
            f"{subject.label} ignores its input: changing the token at position {t} changes no logit at or after "
            f"it (largest change {after:.3g}); the kit expects some to change by more than {tolerance:.3g}"
        )


@category_check("models")
def check_forward_is_deterministic_in_eval_mode(subject: Subject) -> None:
    model = _build(subject).eval()
    ids = _tokens(BATCH, _seq(model), _vocab(subject))
    with torch.no_grad():
        first, again = _logits(subject, model, ids), _logits(subject, model, ids)
    gap = (first - again).abs().nan_to_num(float("inf")).max().item()
    assert torch.equal(first, again), (
        f"{subject.label}: in eval mode two forwards of the same tokens give logits up to {gap:.3g} apart; the kit "
        "expects identical logits (dropout or other randomness left on outside training?)"
    )


@category_check("models")
def check_documents_do_not_attend_to_each_other(subject: Subject) -> None:
    """Packed rows (a first document, then a second) against each document run alone: RoPE is
    relative, so a document's logits do not depend on where it starts (within fp32 rounding)."""
    model = _build(subject).eval()
    if "document_ids" not in inspect.signature(model.forward).parameters:
        skip_check(f"{subject.label}'s forward takes no document_ids: it does not pack documents")
    vocab, seq = _vocab(subject), _seq(model)
    splits = (seq // 3, seq - seq // 4)  # where the second document of each row starts
    ids = _tokens(len(splits), seq, vocab)
    documents = torch.stack([(torch.arange(seq) >= split).long() for split in splits])
    with torch.no_grad():
        packed = _logits(subject, model, ids, document_ids=documents)
        for row, split in enumerate(splits):
            for name, part in (("first", slice(0, split)), ("second", slice(split, seq))):
                alone = _logits(subject, model, ids[row : row + 1, part])[0]
                tolerance = DOCUMENT_TOLERANCE * _scale(alone)
                gap = (packed[row, part] - alone).abs().max().item()
                assert gap <= tolerance, (
                    f"{subject.label}: with document_ids, the {name} document of a packed row (tokens {part.start} "
                    f"to {part.stop - 1} of {seq}) gets logits up to {gap:.3g} away from those of the document run "
                    f"alone; the kit expects them equal within {tolerance:.3g} (a token attends only within its "
                    "own document)"
                )


@category_check("models")
def check_initial_weights_depend_on_the_seed_only(subject: Subject) -> None:
    first, again = _build(subject, seed=SEEDS[0]), _build(subject, seed=SEEDS[0])
    differs = first_difference(first, again)
    assert differs is None, (
        f"{subject.label}: build_model twice with seed={SEEDS[0]} gives different weights: {differs}; the kit "
        "expects identical ones (set every value through the Initializer in init_weights(init), never with "
        "torch.nn.init or torch's global generator)"
    )
    other = _build(subject, seed=SEEDS[1])
    assert first_difference(first, other) is not None, (
        f"{subject.label}: build_model with seeds {SEEDS[0]} and {SEEDS[1]} gives identical weights; the kit "
        "expects the seed to change the random ones (init.normal draws from it)"
    )


@category_check("models")
def check_meta_build_materialises_to_the_plain_build(subject: Subject) -> None:
    """What a sharded run does: build on the meta device, then :func:`materialize`. Values drawn
    in the constructor (``torch.nn.init``, ``torch.randn``) do not survive it."""
    from forge_lm.model.init import materialize

    model = _build(subject, seed=SEEDS[0], device="meta")
    real = [name for name, tensor in named_tensors(model) if not tensor.is_meta]
    assert not real, (
        f"{subject.label}: built on the meta device, {real[:5]} still hold memory; the kit expects every parameter "
        "and buffer on the meta device (create tensors without an explicit device in the constructor)"
    )
    try:
        materialize(model, torch.device("cpu"), SEEDS[0])
    except (ForgeError, RuntimeError, NotImplementedError) as exc:
        raise AssertionError(
            f"{subject.label}: a model built on the meta device cannot be materialized: {str(exc).rstrip('.')}; "
            "the kit expects init_weights(init) to set every parameter and buffer through the Initializer"
        ) from exc
    differs = first_difference(model, _build(subject, seed=SEEDS[0]))
    assert differs is None, (
        f"{subject.label}: built on the meta device and materialized with seed={SEEDS[0]}, the model differs from "
        f"build_model with that seed at {differs}; the kit expects them bitwise equal (values set in the "
        "constructor, by torch.nn.init or torch.randn, are lost on the meta device: set them in init_weights(init))"
    )


def _training_loss(subject: Subject, model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A loss on the logits plus every auxiliary loss the model reports, as the training loop
    computes it (:func:`forge_lm.losses.aux.collect_aux`: an MoE's balance loss, multi-token
    prediction; modules that train only through one run only inside a collector)."""
    from forge_lm.losses.aux import collect_aux

    with collect_aux() as reported:
        logits = _logits(subject, model, ids)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    extra = reported.total()
    return loss if extra is None else loss + extra


@category_check("models")
def check_every_trainable_parameter_gets_a_gradient(subject: Subject) -> None:
    model = _build(subject).train()
    vocab, seq = _vocab(subject), _seq(model)
    _training_loss(subject, model, _tokens(BATCH, seq, vocab), _tokens(BATCH, seq, vocab, seed=4)).backward()
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, p in trainable if p.grad is None]
    assert not missing, (
        f"{subject.label}: {len(missing)} of {len(trainable)} trainable parameters receive no gradient from a loss "
        f"on the logits and the auxiliary losses: {missing}; the kit expects every trainable parameter to get one"
    )
    bad = [name for name, p in trainable if not torch.isfinite(p.grad).all()]
    assert not bad, f"{subject.label}: parameters {bad} get non-finite gradients; the kit expects finite ones"


@category_check("models")
def check_cached_decoding_matches_the_full_forward(subject: Subject) -> None:
    """Prefill half the sequence into ``new_kv_cache()``, then decode token by token: each
    step's logits are those of the full forward at that position."""
    model = _build(subject).eval()
    if not isinstance(model, DecodesWithCache):
        skip_check(f"{subject.label} has no new_kv_cache(): it does not decode with a cache")
    vocab, seq = _vocab(subject), _seq(model)
    ids, prefill = _tokens(BATCH, seq, vocab), seq // 2
    with torch.no_grad():
        full = _logits(subject, model, ids)
        cache = model.new_kv_cache(seq)
        steps = [_logits(subject, model, ids[:, :prefill], kv_cache=cache)]
        steps += [_logits(subject, model, ids[:, t : t + 1], kv_cache=cache) for t in range(prefill, seq)]
    decoded = torch.cat(steps, dim=1)
    assert decoded.shape == full.shape, (
        f"{subject.label}: prefill of {prefill} tokens and {seq - prefill} decode steps give logits of shape "
        f"{tuple(decoded.shape)}; the kit expects those of the full forward, {tuple(full.shape)}"
    )
    tolerance = CACHE_TOLERANCE * _scale(full)
    gaps = (decoded - full).abs().amax(dim=(0, 2))  # per position
    worst = int(gaps.argmax())
    assert gaps[worst].item() <= tolerance, (
        f"{subject.label}: with a KV cache (prefill of {prefill} tokens, then one token at a time) the logits at "
        f"positions {(gaps > tolerance).nonzero().flatten().tolist()} differ from the full forward's by up to "
        f"{gaps[worst].item():.3g} (position {worst}); the kit expects them equal within {tolerance:.3g}"
    )


def _flop_formulas() -> dict:
    """FLOP formulas for FlopCounterMode's ``custom_mapping``: grouped matrix products (MoE
    experts) and SDPA's CPU kernel, which torch does not count, and every SDPA backward counted
    as the two gradient products of each forward product. Torch counts five products there:
    fused kernels (FlashAttention) recompute the scores to save memory, work the
    ``12 * n_layers * dim * seq_len`` convention leaves out."""
    from torch.utils.flop_counter import sdpa_flop_count

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return 2 * sdpa_flop_count(query, key, value)

    def grouped(a, b, *args, out_shape=None, **kwargs):
        if len(a) == 2 and len(b) == 2:  # [K, tokens] x [tokens, N], one [K, N] per group of tokens
            return 2 * a[0] * a[1] * b[1]
        return 2 * math.prod(out_shape) * a[-1]

    formulas = {aten._scaled_dot_product_flash_attention_for_cpu: forward}
    if hasattr(aten, "_grouped_mm"):
        formulas[aten._grouped_mm] = grouped
    for kernel in ("flash_attention", "efficient_attention", "cudnn_attention", "flash_attention_for_cpu"):
        op = getattr(aten, f"_scaled_dot_product_{kernel}_backward", None)
        if op is not None:  # every kernel this torch build has
            formulas[op] = backward
    return formulas


@category_check("models")
def check_flops_per_token_matches_the_counted_matmuls(subject: Subject) -> None:
    """``flops_per_token(T)`` against the products torch counts in a training forward (auxiliary
    losses included) and backward of one sequence of ``T`` tokens (``torch.utils.flop_counter``;
    Forge's linear layers run on aten's kernels while counting, since torch does not count their
    oneDNN path; see :func:`_flop_formulas` for the products the kit counts itself).

    The convention is PaLM's: ``6 * N + 12 * n_layers * dim * T``, the scores and the weighted
    sum over the whole ``T x T`` square (causal masking's halving is not subtracted), which is
    what torch counts too. For the ``llama`` family the relation is exact: the declared number
    is the counted one plus ``6`` per parameter of fewer than 2 dimensions (norm scales and
    biases are in ``N`` but are no matrix product). So the kit accepts anything within
    :data:`FLOPS_TOLERANCE` (1%) of the count, or of the count plus that, and nothing further:
    at its sizes attention's term is about a fifth of the total, so a family that leaves it out
    or counts it twice is off by 10% or more.
    """
    from torch.utils.flop_counter import FlopCounterMode

    from forge_lm.model.linear import kernel

    model = _build(subject).train()
    if not isinstance(model, CountsFlops):
        skip_check(f"{subject.label} has no flops_per_token(): MFU counts 6 * its active parameters")
    seq = _seq(model, FLOPS_SEQ)
    ids = _tokens(1, seq, _vocab(subject))
    targets = _tokens(1, seq, _vocab(subject), seed=4)
    with kernel("aten"), FlopCounterMode(display=False, custom_mapping=_flop_formulas()) as counter:
        _training_loss(subject, model, ids, targets).backward()
    counted = counter.get_total_flops() / seq
    vectors = sum(p.numel() for m in model.modules() if not isinstance(m, nn.Embedding)
                  for p in m.parameters(recurse=False) if p.ndim < 2)  # fmt: skip
    declared = float(model.flops_per_token(seq))
    low, high = counted * (1 - FLOPS_TOLERANCE), (counted + 6 * vectors) * (1 + FLOPS_TOLERANCE)
    assert low <= declared <= high, (
        f"{subject.label}: flops_per_token({seq}) declares {declared:.6g} FLOPs per token, but a forward and backward "
        f"of one sequence of {seq} tokens counts {counted:.6g} per token in matrix products (attention's included); "
        f"the kit expects between {low:.6g} and {high:.6g} (the count, plus 6 per vector parameter, within "
        f"{FLOPS_TOLERANCE:.0%}; the attention term 12 * n_layers * dim * seq_len is counted without halving)"
    )


@category_check("models")
def check_parameter_roles_cover_every_parameter(subject: Subject) -> None:
    model = _build(subject)
    roles = parameter_roles(model)
    names = [name for name, _ in model.named_parameters()]
    missing, extra = [n for n in names if n not in roles], [n for n in roles if n not in names]
    assert not missing and not extra, (
        f"{subject.label}: parameter_roles(model) leaves out {missing} and names {extra}, which are not parameters; "
        f"the kit expects exactly the names named_parameters() gives ({len(names)})"
    )
    unknown = {name: role for name, role in roles.items() if role not in PARAMETER_ROLES}
    assert not unknown, f"{subject.label}: unknown roles {unknown}; the kit expects each to be one of {PARAMETER_ROLES}"
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    by_id = {id(p): name for name, p in model.named_parameters()}
    wrong = {by_id[i]: roles[by_id[i]] for i in embeddings if i in by_id and roles[by_id[i]] != "embedding"}
    assert not wrong, (
        f"{subject.label}: the embedding tables {sorted(wrong)} have roles {sorted(set(wrong.values()))}; the kit "
        "expects 'embedding'"
    )
    # The head: the kit's vocabulary is prime, so only the embedding and the head have a dimension of
    # its size; a head tied to the embedding is the embedding's tensor, checked above.
    vocab = _vocab(subject)
    heads = [n for n, p in model.named_parameters() if p.ndim >= 2 and p.shape[0] == vocab and id(p) not in embeddings]
    wrong = {n: roles[n] for n in heads if roles[n] != "output"}
    assert not wrong, (
        f"{subject.label}: the weights {sorted(wrong)} of shape [vocab, ...] (the output head) have roles "
        f"{sorted(set(wrong.values()))}; the kit expects 'output', or 'embedding' for a head tied to the embedding "
        "(name the head `output`, define get_output_embeddings(), or declare parameter_roles())"
    )


@category_check("models")
def check_generation_limits_are_the_models(subject: Subject) -> None:
    """A :class:`~forge_lm.components.GenerationLimits` model's ``vocab_size`` is its logits' width
    and its ``max_seq_len`` the options' (``forge generate`` refuses prompts by them)."""
    model = _build(subject).eval()
    if not isinstance(model, GenerationLimits):
        skip_check(f"{subject.label} declares no GenerationLimits (vocab_size, max_seq_len)")
    vocab, limit = model.vocab_size, model.max_seq_len
    for name, value in (("vocab_size", vocab), ("max_seq_len", limit)):
        assert isinstance(value, int) and not isinstance(value, bool) and value > 0, (
            f"{subject.label}: model.{name} is {value!r}; the kit expects a positive int (GenerationLimits)"
        )
    with torch.no_grad():
        width = _logits(subject, model, _tokens(1, 2, vocab)).shape[-1]
    assert width == vocab, (
        f"{subject.label}: model.vocab_size is {vocab} but its logits have {width} columns; the kit expects them equal"
    )
    configured = getattr(subject.options(), "max_seq_len", None)
    assert configured is None or limit == configured, (
        f"{subject.label}: model.max_seq_len is {limit} but its options' max_seq_len is {configured}; the kit "
        "expects the model's to be the one configured"
    )


class _StandInGroup:
    """What :meth:`~forge_lm.components.ContextParallelModel.set_context_parallel` is handed, as
    the protocol describes it (``gather``, ``gather_ids``, ``rank``, ``size``), without a process
    group: its ``gather`` is that of a group whose ranks all hold the same values."""

    rank, size = 0, 2

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat([x] * self.size, dim=dim)

    def gather_ids(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat([x] * self.size, dim=dim)

    def __repr__(self) -> str:
        return "the kit's stand-in context-parallel group"


def _paths(names: list[str]) -> str:
    return ", ".join(name or "(the model itself)" for name in names)


@category_check("models")
def check_set_context_parallel_reaches_every_layer_declaring_it(subject: Subject) -> None:
    """``set_context_parallel(group)`` of a :class:`~forge_lm.components.ContextParallelModel`
    sets ``context_parallel`` on the model and on every module of it that declares the attribute
    (:class:`~forge_lm.components.ContextParallelAttention`): the core calls it instead of
    walking the modules (plugin API 1.3), so a layer it misses attends within its rank's slice
    only. ``set_context_parallel(None)`` then sets None on each of them again. A model refusing
    the group (a layer that cannot gather, named in a ForgeError) skips the check."""
    from forge_lm.distributed.context_parallel import declares_only_the_attribute

    model = _build(subject)
    if not isinstance(model, ContextParallelModel):
        how = (
            "declares only the context_parallel attribute (plugin API 1.2's ContextParallelModel, deprecated)"
            if declares_only_the_attribute(model)
            else "declares no set_context_parallel(context_parallel) (ContextParallelModel)"
        )
        skip_check(f"{subject.label} {how}: the kit checks set_context_parallel on a model that defines it")
    declaring = [name for name, module in model.named_modules() if isinstance(module, ContextParallelAttention)]
    group = _StandInGroup()
    try:
        model.set_context_parallel(group)
    except ForgeError as exc:
        skip_check(f"{subject.label} refuses context parallelism with these options: {str(exc).rstrip('.')}")
    except Exception as exc:
        raise AssertionError(
            f"{subject.label}: set_context_parallel({group!r}) raised {type(exc).__name__}: {exc}; the kit expects it "
            "to set the object on the model's layers, or to refuse with a ForgeError naming the layer that cannot "
            "gather (the object has gather(x, dim), gather_ids(x, dim), rank and size, and nothing more)"
        ) from exc
    modules = dict(model.named_modules())
    missed = [name for name in declaring if getattr(modules[name], "context_parallel", None) is not group]
    assert not missed, (
        f"{subject.label}: set_context_parallel(context_parallel) does not reach {_paths(missed)} ({len(missed)} of "
        f"the {len(declaring)} modules declaring a context_parallel attribute); the kit expects each to hold the "
        "object passed (the core calls set_context_parallel and no longer walks the modules, so a layer it misses "
        "attends only within its rank's slice of the sequence): override set_context_parallel, call "
        "super().set_context_parallel(context_parallel) and set context_parallel on those layers too"
    )
    model.set_context_parallel(None)
    kept = [name for name in declaring if getattr(modules[name], "context_parallel", None) is not None]
    assert not kept, (
        f"{subject.label}: set_context_parallel(None) leaves context_parallel set on {_paths(kept)}; the kit expects "
        "None on every module declaring it again (attention within the rank's own tokens): have "
        "set_context_parallel hand None to those layers as it hands them the group"
    )
