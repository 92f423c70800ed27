"""Growing a model: ``[checkpoint] init_from`` weights into a larger ``[model]``, by the rules of
``[checkpoint.growth]``.

Every tensor of the new model comes out of one of three ways, and is reported as such:

- **copied**: the source's tensor of the same shape (a layer's from the source layer it maps to);
- **grown**: the source's tensor fills the leading part of a larger one (``width = "preserve"``:
  the first hidden units of a feed-forward layer), or a module grew it along its own axis
  (:class:`~forge_lm.components.GrowsWeights`: forge-moe's experts, ``experts = "copy"``);
- **new**: a tensor of a new layer (``depth``), or a feed-forward tensor the source has none of
  (``width``: shared experts where the source had none).

Depth: with ``n`` source layers and ``m > n`` new ones, new layer ``j`` takes source layer
``j * n // m``; the first new layer that takes a source layer is that layer (copied), the others
are new copies of it, placed right above it. ``depth = "zero"`` zeroes a new layer's
projections into the residual stream, so the layer adds nothing to the residual stream: the
grown model computes what the source did. Which projections those are, each module says itself
through the initialisation contract: the tensors its ``init_weights(init)`` draws with
``init.residual_std`` (attention out, FFN down, experts' down). A new layer whose attention or
feed-forward declares none cannot be made the identity, and is refused.

Width: a tensor of a feed-forward layer (``layers.N.feed_forward.*``) larger than the source's in
some dimensions (and no smaller in any) keeps the source's values in its leading part; the rest
is this run's own initialisation, except in the residual projections, where it is zero. New
hidden units therefore add nothing until they train: the grown model computes what the source
did. Wider ``dim``, more heads, another head size or vocabulary are refused: with RMSNorm over
a wider residual stream no expansion keeps the function.

A shape the rules set do not cover is refused before anything is written
(:class:`~forge_lm.errors.ConfigError`, exit 2), naming the tensors and the option that would
cover them. Every rank runs the same computation on the full source weights (noise from a
generator seeded by the run's seed), so every rank holds the same grown weights.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from forge_lm.components import GrowsWeights
from forge_lm.errors import ConfigError
from forge_lm.model.init import Initializer

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")  # not in state-dict names
_SHOWN = 5  # problems named in a refusal
# The std the residual finder hands modules as init.residual_std: a value no module computes from
# init.std = 1.0, so a draw with exactly it is a draw "with residual_std".
_RESIDUAL_MARK = 0.012345678901234


@attrs.frozen
class Entry:
    """One tensor of the new model: how it was made (``copied``, ``grown`` or ``new``), from which
    source tensor, and the two shapes."""

    name: str
    how: str
    source: str | None
    shape: tuple[int, ...]
    source_shape: tuple[int, ...] | None
    note: str = ""


@attrs.frozen
class Growth:
    weights: dict[str, torch.Tensor]
    entries: list[Entry]

    @property
    def grew(self) -> bool:
        return any(entry.how != "copied" or entry.source != entry.name for entry in self.entries)


def grow(
    source: Mapping[str, torch.Tensor], model: nn.Module, target: Mapping[str, Any], rules: Any, seed: int, where: str
) -> Growth:
    """The full weights of ``model`` (whose state dict, sharded or not, is ``target``) made from
    ``source`` by ``rules`` (``[checkpoint.growth]``). Raises ConfigError naming what does not fit;
    ``where`` names the source in messages."""
    shapes = {name: tuple(tensor.shape) for name, tensor in target.items()}
    layers, new_layers = _depth_plan(source, shapes, rules, where)
    origin = {name: _mapped(name, layers) for name in shapes}
    prepared, expanded = _grown_by_modules(source, model, shapes, layers, rules, seed)
    residual = residual_projections(model)
    if new_layers and rules.depth == "zero":
        _check_identity_possible(new_layers, shapes, residual)
    weights: dict[str, torch.Tensor] = {}
    entries: list[Entry] = []
    problems: list[str] = []
    for name, shape in shapes.items():
        from_name = origin[name]
        value = prepared.get(from_name, source.get(from_name))
        layer = _layer_of(name)
        is_new = layer in new_layers
        if value is None:
            if rules.width == "preserve" and ".feed_forward." in name and not is_new:
                zero, fresh = name in residual, _fresh(target[name])
                weights[name] = torch.zeros_like(fresh) if zero else fresh
                entries.append(Entry(name, "new", None, shape, None, "zeros" if zero else "this run's init"))
            else:
                problems.append(f"'{from_name}' is missing from the source")
            continue
        source_shape = tuple(source[from_name].shape) if from_name in source else None
        if tuple(value.shape) != shape:
            if not _grows_by_width(name, tuple(value.shape), shape):
                problems.append(f"'{name}' is {list(value.shape)} in the source but {list(shape)} here")
                continue
            if rules.width != "preserve":
                problems.append(
                    f"'{name}' is {list(value.shape)} in the source but {list(shape)} here (set [checkpoint.growth] "
                    "width = 'preserve' to grow the feed-forward hidden units)"
                )
                continue
            value = _corner(value, _fresh(target[name]), zero_rest=name in residual)
            how, note = "grown", "source in the leading part"
        else:
            value = value.detach().clone()
            how, note = "copied", ""
        if from_name in expanded:
            how, note = "grown", expanded[from_name]
        if is_new:
            zero = rules.depth == "zero" and name in residual
            if zero:
                value = torch.zeros_like(value)
            how, note = "new", "zeros" if zero else f"copy of {from_name}"
        weights[name] = value.to(target[name].dtype)
        entries.append(Entry(name, how, from_name, shape, source_shape, note))
    used = set(origin.values())
    problems += [f"'{name}' is not in this run's model" for name in source if name not in used]
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise ConfigError(
            f"[checkpoint] init_from: the weights of '{where}' do not fit this run's [model]: "
            f"{'; '.join(problems[:_SHOWN])}{more}. Set [model] to the source's sizes, or say how to grow it in "
            "[checkpoint.growth] (depth for more layers, width = 'preserve' for wider feed-forward layers, "
            "experts = 'copy' for more experts), or start without init_from."
        )
    return Growth(weights, entries)


def report_lines(growth: Growth) -> list[str]:
    """The table printed at the start: every tensor, its shapes and how it was made."""
    rows = [
        (
            entry.name,
            "-" if entry.source_shape is None else str(list(entry.source_shape)),
            str(list(entry.shape)),
            entry.how + (f" ({entry.note})" if entry.note else ""),
        )
        for entry in growth.entries
    ]
    header = ("tensor", "source", "shape", "how")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    return [f"  {a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}".rstrip() for a, b, c, d in [header, *rows]]


def residual_projections(model: nn.Module) -> set[str]:
    """Names (as in the state dict) of the tensors the model's modules initialise with
    ``init.residual_std``: the projections that write into the residual stream."""
    finder = _ResidualFinder(model)
    finder.module(model)
    return {_state_dict_name(name) for name in finder.residual}


class _ResidualFinder(Initializer):
    """Runs the modules' ``init_weights(init)`` writing nothing, noting which tensors are drawn
    with ``init.residual_std``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, seed=0, std=1.0, residual_std=_RESIDUAL_MARK)
        self.residual: set[str] = set()

    def normal(self, tensor: torch.Tensor, std: float, mean: float = 0.0) -> None:
        if std == _RESIDUAL_MARK:
            self.residual.add(self.name_of(tensor))

    def constant(self, tensor: torch.Tensor, value: float) -> None:
        self.name_of(tensor)

    def copy(self, tensor: torch.Tensor, values: torch.Tensor) -> None:
        self.name_of(tensor)


def _state_dict_name(name: str) -> str:
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _layer_of(name: str) -> int | None:
    match = _LAYER.fullmatch(name)
    return int(match.group(1)) if match else None


def _layer_count(names: Any) -> int:
    indices = {index for index in map(_layer_of, names) if index is not None}
    return max(indices) + 1 if indices else 0


def _depth_plan(
    source: Mapping[str, Any], shapes: Mapping[str, Any], rules: Any, where: str
) -> tuple[dict[int, int], set[int]]:
    """``{new layer: source layer}`` and the new layers that are copies of another (see the module
    docstring)."""
    have, want = _layer_count(source), _layer_count(shapes)
    if want == have or not have:
        return {i: i for i in range(want)}, set()
    if want < have:
        raise ConfigError(
            f"[checkpoint] init_from: '{where}' has {have} layers but [model] n_layers is {want}: growth only adds "
            "layers; set n_layers to at least the source's."
        )
    if rules.depth == "none":
        raise ConfigError(
            f"[checkpoint] init_from: '{where}' has {have} layers but this run's [model] has {want}, so layers "
            f"{', '.join(f'layers.{j}' for j in range(have, want))} have no weights: set [checkpoint.growth] "
            "depth = 'zero' (new layers are the identity: the model computes what the source did) or 'copy' "
            "(new layers are copies of their neighbours)."
        )
    plan = {j: j * have // want for j in range(want)}
    first = {}
    for j, i in plan.items():
        first.setdefault(i, j)
    return plan, {j for j, i in plan.items() if first[i] != j}


def _mapped(name: str, layers: Mapping[int, int]) -> str:
    match = _LAYER.fullmatch(name)
    if match is None or int(match.group(1)) not in layers:
        return name
    return f"layers.{layers[int(match.group(1))]}.{match.group(2)}"


def _grown_by_modules(
    source: Mapping[str, torch.Tensor],
    model: nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    layers: Mapping[int, int],
    rules: Any,
    seed: int,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Source tensors replaced by the modules that grow their own axis (:class:`GrowsWeights`),
    by source name, and a note for each. A source module that several new layers copy is grown
    once, so its copies are equal."""
    generator = torch.Generator().manual_seed(int(seed))
    prepared: dict[str, torch.Tensor] = {}
    notes: dict[str, str] = {}
    done: set[str] = set()
    for module_name, module in model.named_modules():
        if not isinstance(module, GrowsWeights) or not module_name:
            continue
        prefix = _state_dict_name(module_name) + "."
        source_prefix = _mapped(prefix.rstrip("."), layers) + "."
        if source_prefix in done:
            continue
        local_shapes = {name[len(prefix) :]: shape for name, shape in shapes.items() if name.startswith(prefix)}
        local_source = {name[len(source_prefix) :]: t for name, t in source.items() if name.startswith(source_prefix)}
        if all(tuple(local_source[n].shape) == s for n, s in local_shapes.items() if n in local_source):
            continue
        done.add(source_prefix)
        replaced = module.grow_source(local_source, local_shapes, rules, generator)
        for local, tensor in replaced.items():
            prepared[source_prefix + local] = tensor
            notes[source_prefix + local] = f"grown by {type(module).__name__}"
    return prepared, notes


def _check_identity_possible(new_layers: set[int], shapes: Mapping[str, Any], residual: set[str]) -> None:
    for layer in sorted(new_layers):
        for part in ("attention", "feed_forward"):
            prefix = f"layers.{layer}.{part}."
            if any(name.startswith(prefix) for name in shapes) and not any(n.startswith(prefix) for n in residual):
                raise ConfigError(
                    f"[checkpoint.growth] depth = 'zero': the {part} of layers.{layer} declares no projection into "
                    "the residual stream (none drawn with init.residual_std in its init_weights), so zeroing cannot "
                    "make the new layer the identity; use depth = 'copy'."
                )


def _grows_by_width(name: str, have: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Whether the width rule can grow this tensor: a feed-forward tensor, no dimension smaller."""
    return ".feed_forward." in name and len(have) == len(want) and all(h <= w for h, w in zip(have, want, strict=True))


def _corner(value: torch.Tensor, fresh: torch.Tensor, zero_rest: bool) -> torch.Tensor:
    """``fresh`` (or zeros) with ``value`` in its leading part."""
    out = torch.zeros_like(fresh) if zero_rest else fresh.clone()
    out[tuple(slice(0, size) for size in value.shape)] = value.to(out.dtype)
    return out


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """This run's own initial values of a tensor, whole (a collective for a DTensor: every rank
    calls it for the same tensors in the same order)."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full.detach().to("cpu", copy=True)
