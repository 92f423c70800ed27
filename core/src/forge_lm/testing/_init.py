"""Initialisation checks shared by the layer categories (attention and feed-forward layers).

A layer is initialised as a model initialises it (:func:`forge_lm.model.init.initialize`):
its ``init_weights(init)`` or the default rule. Every value must come through the
:class:`~forge_lm.components.Initializer`: then the seed alone decides the weights and a layer
built on the meta device (a sharded run) gets the values a plain build gets.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from forge_lm.errors import ForgeError
from forge_lm.testing._kit import Subject

INIT_STD = 0.02
SEEDS = (1, 2)

Builder = Callable[[], object]
"""Builds the layer from its factory (the kit's sizes and options)."""


def initialised(subject: Subject, build: Builder, seed: int, n_layers: int, device: str | None = None) -> nn.Module:
    """The layer ``build`` gives (on ``device``; from the meta device given memory on the CPU),
    initialised with ``seed`` as a model of ``n_layers`` blocks does it."""
    from forge_lm.model.init import initialize

    # As build_model: whatever the constructor draws from torch's generator leaves it as it was.
    with torch.random.fork_rng(), torch.device(device) if device else contextlib.nullcontext():
        layer = build()
    assert isinstance(layer, nn.Module), (
        f"{subject.label} returned {type(layer).__name__}; the kit expects a torch.nn.Module"
    )
    if device == "meta":
        layer.to_empty(device="cpu")
    try:
        initialize(layer, seed, INIT_STD, INIT_STD / math.sqrt(2 * n_layers))
    except (ForgeError, RuntimeError, NotImplementedError) as exc:
        where = " built on the meta device" if device == "meta" else ""
        raise AssertionError(
            f"{subject.label}{where} cannot be initialised: {str(exc).rstrip('.')}; the kit expects "
            "init_weights(init) to set every parameter and buffer through the Initializer"
        ) from exc
    return layer


def named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module``, by name."""
    yield from module.named_parameters()
    yield from module.named_buffers()


def first_difference(a: nn.Module, b: nn.Module) -> str | None:
    """The first parameter or buffer whose values differ between two builds, described."""
    theirs = dict(named_tensors(b))
    for name, tensor in named_tensors(a):
        other = theirs.get(name)
        if other is None or other.shape != tensor.shape:
            return f"{name} (present in one build only, or of another shape)"
        if not torch.equal(tensor.detach().cpu(), other.detach().cpu()):
            gap = (tensor.detach().cpu().double() - other.detach().cpu().double()).abs().nan_to_num(float("inf"))
            return f"{name} (up to {gap.max().item():.3g} apart)"
    return None


def check_weights_depend_on_the_seed_only(subject: Subject, build: Builder, n_layers: int) -> None:
    """Two builds with one seed agree bitwise; another seed changes the random values."""
    first = initialised(subject, build, SEEDS[0], n_layers)
    differs = first_difference(first, initialised(subject, build, SEEDS[0], n_layers))
    assert differs is None, (
        f"{subject.label}: initialised twice with seed={SEEDS[0]} it gets different weights: {differs}; the kit "
        "expects identical ones (set every value through the Initializer in init_weights(init), never with "
        "torch.nn.init or torch's global generator)"
    )
    if any(True for _ in first.parameters()):
        assert first_difference(first, initialised(subject, build, SEEDS[1], n_layers)) is not None, (
            f"{subject.label}: seeds {SEEDS[0]} and {SEEDS[1]} give identical weights; the kit expects the seed to "
            "change the random ones (init.normal draws from it)"
        )


def check_meta_build_equals_the_plain_build(subject: Subject, build: Builder, n_layers: int) -> None:
    """Built on the meta device, given memory and initialised (what a sharded run does), the
    layer equals the one built in memory: values set in the constructor do not survive."""
    on_meta = initialised(subject, build, SEEDS[0], n_layers, device="meta")
    differs = first_difference(on_meta, initialised(subject, build, SEEDS[0], n_layers))
    assert differs is None, (
        f"{subject.label}: built on the meta device and initialised with seed={SEEDS[0]}, the layer differs from "
        f"the one built in memory at {differs}; the kit expects them bitwise equal (values set in the constructor, "
        "by torch.nn.init or torch.randn, are lost on the meta device: set them in init_weights(init))"
    )
