"""Model transform contract: ``factory(options) -> forge_lm.distributed.ModelTransform(slot,
enabled, apply)``.

The kit builds a one-process CPU run's :class:`~forge_lm.distributed.TransformContext` (a tiny
llama-family model, the transform's options in ``[transforms.<name>]``, the aid ``config``
merged over the run config) and checks: the slot is one of
:data:`~forge_lm.distributed.TRANSFORM_ORDER`; ``enabled(context)`` answers a bool; neither
``enabled`` nor ``apply`` changes the config; ``apply`` keeps parameter names and leaves at
least one parameter to train. The checks of ``apply`` are skipped, saying why, for a transform
not enabled in that run (give it ``options`` or ``config`` that enable it).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from forge_lm.testing._kit import Subject, category_check, skip_check

TINY_MODEL = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64}
VOCAB = 64


def _config(subject: Subject) -> Any:
    from forge_lm.config import merge, structure_config

    table = {
        "model": dict(TINY_MODEL),
        "train": {"seq_len": 16, "batch_size": 2, "device": "cpu"},
        "transforms": {subject.component.name: dict(subject.options_table)},
    }
    return structure_config(merge(table, subject.extras.get("config") or {}), subject.manager.registry)


def _context(subject: Subject) -> Any:
    from forge_lm.distributed import ParallelDims, TransformContext

    return TransformContext(_config(subject), ParallelDims(), None, torch.device("cpu"), None)


def _transform(subject: Subject) -> Any:
    from forge_lm.distributed import TRANSFORM_ORDER, ModelTransform

    transform = subject.build()
    assert isinstance(transform, ModelTransform), (
        f"{subject.label} returned {type(transform).__name__}; the kit expects a "
        "forge_lm.distributed.ModelTransform(slot, enabled, apply)"
    )
    assert transform.slot in TRANSFORM_ORDER, (
        f"{subject.label} names slot {transform.slot!r}; the kit expects one of {', '.join(TRANSFORM_ORDER)} "
        "('adaptation' for a transform that is not a parallelism: freezing, LoRA, pruning)"
    )
    assert callable(transform.enabled) and callable(transform.apply), (
        f"{subject.label}: enabled is {type(transform.enabled).__name__} and apply {type(transform.apply).__name__}; "
        "the kit expects two callables, enabled(context) -> bool and apply(model, context) -> None"
    )
    return transform


def _model(context: Any, subject: Subject) -> nn.Module:
    from forge_lm.model import build_model

    return build_model(context.config.model, VOCAB, subject.manager.registry, seed=0)


def _enabled(subject: Subject, transform: Any, context: Any) -> bool:
    answer = transform.enabled(context)
    assert isinstance(answer, bool), (
        f"{subject.label}: enabled(context) returned {answer!r} ({type(answer).__name__}); the kit expects a bool "
        "(True or False: the core refuses anything else)"
    )
    return answer


@category_check("model_transforms")
def check_is_a_model_transform_in_a_known_slot(subject: Subject) -> None:
    _transform(subject)


@category_check("model_transforms")
def check_enabled_answers_a_bool(subject: Subject) -> None:
    _enabled(subject, _transform(subject), _context(subject))


def _snapshot(config: Any) -> Any:
    from forge_lm.config import to_data

    return copy.deepcopy(to_data(config))


def _first_change(before: Any, after: Any, where: str = "") -> str:
    """The first key (as ``[section] key``) whose value differs between two config tables."""
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(set(before) | set(after), key=str):
            if before.get(key, "<absent>") != after.get(key, "<absent>"):
                return _first_change(before.get(key, "<absent>"), after.get(key, "<absent>"), f"{where}.{key}")
    section, _, key = where.lstrip(".").rpartition(".")
    return f"[{section}] {key}: {before!r} -> {after!r}" if section else f"{key}: {before!r} -> {after!r}"


@category_check("model_transforms")
def check_leaves_the_config_unchanged(subject: Subject) -> None:
    """``enabled`` and ``apply`` read the run's config; they never write it (every rank and the
    saved config.toml must keep the one the user gave)."""
    transform, context = _transform(subject), _context(subject)
    before = _snapshot(context.config)
    if transform.enabled(context) is True:
        transform.apply(_model(context, subject), context)
    after = _snapshot(context.config)
    assert before == after, (
        f"{subject.label} changed the run's config: {_first_change(before, after)}; the kit expects enabled() and "
        "apply() to leave context.config as it was (read options, never write them)"
    )


@category_check("model_transforms")
def check_apply_keeps_names_and_leaves_something_to_train(subject: Subject) -> None:
    transform, context = _transform(subject), _context(subject)
    if not _enabled(subject, transform, context):
        skip_check(
            f"{subject.label} is not enabled in the kit's one-process CPU run with options "
            f"{dict(subject.options_table)}; "
            "give it options (or the aid config=) that enable it to check apply()"
        )
    model = _model(context, subject)
    names = [name for name, _ in model.named_parameters()]
    transform.apply(model, context)
    after = {name for name, _ in model.named_parameters()}
    lost = [name for name in names if name not in after]
    assert not lost, (
        f"{subject.label}: after apply() the model no longer has parameters {lost[:5]} ({len(lost)} of {len(names)}); "
        "the kit expects every parameter name kept (checkpoints and plugins address parameters by name)"
    )
    trainable = sum(param.numel() for param in model.parameters() if param.requires_grad)
    total = sum(param.numel() for param in model.parameters())
    assert trainable > 0, (
        f"{subject.label}: after apply() 0 of the model's {total} parameter values require a gradient; the kit "
        "expects at least one left to train (the run would have nothing for the optimizer)"
    )
