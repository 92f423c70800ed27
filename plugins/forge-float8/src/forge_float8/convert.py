"""The ``float8`` model transform: Linear layers swapped for torchao's ``Float8Linear``.

A ``Float8Linear`` keeps its weight in the precision it had (fp32 master weights) and casts
the matmul inputs to float8 with dynamic scales at every call, in forward and backward
(torchao's float8 training, as torchtitan uses it). It takes over the ``weight`` (and
``bias``) parameter objects of the layer it replaces, so parameter names, the optimizer's
view of the model and checkpoints are the same with and without float8.

Which layers are converted is decided first, from the model alone (:func:`conversion_plan`),
so that the decision can be printed and tested without torchao.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import logging
import sys
from typing import Any

import attrs
import torch
from torch import nn

from forge_float8.options import Float8Options
from forge_lm.api import Linear as ForgeLinear
from forge_lm.api import ModelTransform, TransformContext, is_main_process
from forge_lm.errors import ConfigError

HEAD = "output"  # the output head: its logits feed the loss directly (DeepSeek-V3 kept it in bf16 too)
MULTIPLE = 16  # torch._scaled_mm needs both sizes of the weight to be multiples of 16
MIN_CUDA_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (sm89) and Hopper (sm90) onwards


@attrs.frozen
class Plan:
    """Which Linear layers become float8 (``converted``) and why the others do not (``skipped``)."""

    converted: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]  # (module name, reason)

    def describe(self, recipe: str, where: str = "") -> str:
        """The lines the transform prints: a count, then each layer kept in high precision and why.
        ``where``: what part of the model this is, when it is not all of it (a pipeline stage)."""
        total = len(self.converted) + len(self.skipped)
        head = f"forge-float8: {where}{len(self.converted)} of {total} Linear layers train in float8 (recipe {recipe})"
        if not self.skipped:
            return head + "."
        verb = "stays" if len(self.skipped) == 1 else "stay"
        lines = [head + f"; {len(self.skipped)} {verb} in high precision:"]
        lines.extend(f"  {name}: {reason}" for name, reason in self.skipped)
        return "\n".join(lines)


def _first_match(name: str, patterns: list[str]) -> str | None:
    return next((pattern for pattern in patterns if fnmatch.fnmatchcase(name, pattern)), None)


def conversion_plan(model: nn.Module, options: Float8Options, check_patterns: bool = True) -> Plan:
    """Decide, for every ``nn.Linear`` in ``model``, whether it trains in float8.

    ``check_patterns``: an ``include`` or ``exclude`` pattern that names no Linear layer is a
    config error (a typo would otherwise silently change what trains in float8). Off for a
    pipeline stage, which holds only some of the model's layers.
    """
    converted, skipped = [], []
    used: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        included = _first_match(name, options.include) if options.include else "*"
        excluded = _first_match(name, options.exclude)
        used.update(pattern for pattern in (included, excluded) if pattern)
        out_features, in_features = module.weight.shape
        if name == HEAD:
            skipped.append((name, "the output head"))
        elif type(module) not in (nn.Linear, ForgeLinear):
            # Float8Linear replaces the module, so a subclass's own forward would be lost. Forge's
            # own Linear only picks a CPU kernel for its fp32 product: float8 replaces that product.
            skipped.append((name, f"a subclass of nn.Linear ({type(module).__qualname__}), not converted"))
        elif included is None:
            skipped.append((name, "matches no include pattern"))
        elif excluded is not None:
            skipped.append((name, f"excluded by {excluded!r}"))
        elif in_features % MULTIPLE or out_features % MULTIPLE:
            skipped.append(
                (
                    name,
                    f"{in_features} -> {out_features} features; float8 matmuls need both to be multiples of {MULTIPLE}",
                )
            )
        else:
            converted.append(name)
    if check_patterns:
        for key in ("include", "exclude"):
            unused = [pattern for pattern in getattr(options, key) if pattern not in used]
            if unused:
                raise ConfigError(
                    f"[transforms.float8] {key}: {unused!r} match no Linear layer of the model; patterns are "
                    "fnmatch patterns of module names as model.named_modules() gives them, like "
                    "'layers.*.feed_forward.*' or 'layers.0.attention.wq'."
                )
    return Plan(tuple(converted), tuple(skipped))


@functools.cache
def _torchao_float8() -> Any:
    """``torchao.float8``, imported once.

    torchao's import tries to load its compiled CUDA kernels for other formats (MX, CUTLASS)
    and logs a warning for each one that cannot load, as on a machine without CUDA; float8
    training does not use them (its matmul is ``torch._scaled_mm``), so those warnings are
    held back. So is torch's note about torchao registering an enum with pytree.
    """
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    return float8


def float8_config(options: Float8Options, fsdp_all_gather: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for the recipe, with float8 all-gather when asked."""
    float8 = _torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(options.recipe)
    if fsdp_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def check_device(device: torch.device) -> None:
    """Refuse a GPU without float8 tensor cores before anything is converted."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CUDA_CAPABILITY:
        found = ".".join(map(str, capability))
        raise ConfigError(
            f"[transforms.float8] enabled = true, but {torch.cuda.get_device_name(device)} (compute capability "
            f"{found}) has no float8 matmuls; they need compute capability 8.9 or newer (L4, L40S, RTX 4090, "
            "H100, H200, B200). Set enabled = false on this GPU."
        )


def convert(model: nn.Module, options: Float8Options, *, fsdp_all_gather: bool = False, check_patterns: bool = True):
    """Swap the planned Linear layers of ``model`` for ``Float8Linear`` in place; returns the plan.

    Raises ConfigError if no layer can be converted: the run asked for float8 and would get none.
    """
    plan = conversion_plan(model, options, check_patterns)
    if not plan.converted:
        raise ConfigError(
            "[transforms.float8] enabled = true, but no Linear layer of the model can train in float8:\n"
            + "\n".join(f"  {name}: {reason}" for name, reason in plan.skipped)
            + "\nMake the model's sizes multiples of 16, widen include or narrow exclude, or set enabled = false."
        )
    names = [name for name, _ in model.named_parameters()]
    chosen = set(plan.converted)
    _torchao_float8().convert_to_float8_training(
        model, module_filter_fn=lambda module, name: name in chosen, config=float8_config(options, fsdp_all_gather)
    )
    if fsdp_all_gather:
        for name in plan.converted:
            model.get_submodule(name).register_state_dict_post_hook(_plain_weights)
    # Checkpoints, optimizers and other plugins address parameters by name; a torchao release
    # that renamed them would make float8 checkpoints unreadable without float8.
    after = [name for name, _ in model.named_parameters()]
    if after != names:
        changed = sorted(set(names) ^ set(after))
        raise RuntimeError(
            f"forge-float8: converting to float8 changed the model's parameter names ({changed}); this torchao "
            "release is not supported."
        )
    return plan


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` without torchao's float8 all-gather wrapper (the same storage, a plain tensor)."""
    from torch.distributed.tensor import DTensor

    wrapper = _torchao_float8().fsdp_utils.WeightWithDynamicFloat8CastTensor
    if isinstance(tensor, DTensor) and isinstance(tensor._local_tensor, wrapper):
        with torch.no_grad():
            local = tensor._local_tensor._tensor.detach()
            return DTensor.from_local(
                local,
                tensor.device_mesh,
                tensor.placements,
                run_check=False,
                shape=tensor.shape,
                stride=tensor.stride(),
            )
    if isinstance(tensor, wrapper):
        return tensor._tensor.detach()
    return tensor


def _plain_weights(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict hook of a layer whose weight FSDP2 gathers in float8.

    torchao keeps such a weight inside a tensor subclass, and a checkpoint written from it
    would pickle that class: Forge reads tensors with ``torch.load(weights_only=True)``, which
    accepts the class only in a process that imported torchao (``forge export-hf`` and
    ``forge generate`` do not). The state dict gets the plain tensor inside instead; it shares
    the parameter's storage, so a checkpoint loaded into it in place lands in the parameter.
    """
    for name, value in list(state_dict.items()):
        if name.startswith(prefix) and "." not in name[len(prefix) :]:
            state_dict[name] = _plain(value)


def _apply(options: Float8Options, model: nn.Module, context: TransformContext) -> None:
    check_device(context.device)
    # Float8 all-gather only means something when FSDP2 shards the weights (it wraps them in a
    # tensor subclass that casts before the gather); in one process it would only cost time.
    fsdp_all_gather = options.fsdp_float8_all_gather and context.dims.dp_size > 1
    plan = convert(model, options, fsdp_all_gather=fsdp_all_gather, check_patterns=context.dims.pp == 1)
    if is_main_process():
        # Rank 0 holds the first pipeline stage only: say so, rather than seem to describe the model.
        where = "pipeline stage 0: " if context.dims.pp > 1 else ""
        print(plan.describe(options.recipe, where), file=sys.stderr)
        if fsdp_all_gather:
            print("forge-float8: FSDP2 gathers the converted weights in float8", file=sys.stderr)


def float8_transform(options: Float8Options) -> ModelTransform:
    """The ``float8`` transform (slot ``precision``): on when ``[transforms.float8] enabled = true``."""
    return ModelTransform(
        slot="precision", enabled=lambda context: options.enabled, apply=functools.partial(_apply, options)
    )
