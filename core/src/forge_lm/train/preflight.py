"""``forge config validate``'s look ahead: would ``forge train`` start this config here?

It resolves what a launch would (the tokenizer's vocabulary, the parallel degrees with
``dp_shard = -1`` taking this launch's ranks, the device and its precision), checks the
degrees against the model, and reports the memory estimate of :mod:`forge_lm.model.memory`
against this machine's memory, refusing what ``forge train`` would refuse.

A :class:`SimulatedLaunch` checks a config for another machine from this one: the world size
of its launch and the memory of one of its devices (``forge config validate --world-size 8
--device-memory-gib 80``), so that a preset for an 8-GPU node is checked on a laptop's CPU.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from forge_lm.config import ForgeConfig, model_options
from forge_lm.distributed.launch import detect_launch
from forge_lm.distributed.mesh import ParallelDims
from forge_lm.distributed.offload import check_offload
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.model.available_memory import MemoryLimit, host_memory_limit, memory_limit, ranks_on_host
from forge_lm.model.capabilities import check_family_supports
from forge_lm.model.memory import (
    MemoryEstimate,
    estimate_memory,
    format_bytes,
    host_shortfall,
    model_vocab_size,
    refusal,
)
from forge_lm.train.batch_ramp import BatchRamp
from forge_lm.train.device import autocast_dtype, resolve_device

GIB = 2**30


@attrs.frozen
class SimulatedLaunch:
    """The machine a config is meant for, where it is not this one: ``world_size`` ranks in its
    launch (``dp_shard = -1`` takes what the other degrees leave of them), and
    ``device_memory_gib`` GiB on each rank's device, a GPU unless ``[train] device = "cpu"``. A
    field left None is this machine's (the launch's ranks; the device and its free memory)."""

    world_size: int | None = None
    device_memory_gib: float | None = None

    def describe(self, launch_size: int, device: torch.device) -> str:
        """``Simulated: 8 ranks (--world-size), 80 GiB per GPU (--device-memory-gib), no GPU used here.``"""
        parts = []
        if self.world_size is not None:
            parts.append(f"{launch_size} rank{'s' if launch_size != 1 else ''} (--world-size)")
        if self.device_memory_gib is not None:
            parts.append(f"{self.device_memory_gib:g} GiB per {_device_word(device)} (--device-memory-gib)")
            parts.append(f"no {_device_word(device)} used here")
        return f"Simulated: {', '.join(parts)}."


def _device_word(device: torch.device) -> str:
    return "GPU" if device.type == "cuda" else "process"


def validation_report(config: ForgeConfig, registry: Any, simulated: SimulatedLaunch | None = None) -> str:
    """For ``forge config validate``: the estimate, and the device it was checked against, as
    ``forge train`` would run the config here (``dp_shard = -1``: the ranks of this launch, one
    outside ``torchrun``), or on the machine ``simulated`` describes. Raises
    :class:`ConfigError` where ``forge train`` would refuse it."""
    simulated = simulated or SimulatedLaunch()
    vocab_size, vocab_note = _vocab_size(config, simulated)
    if simulated.world_size is not None:
        # A launch of that many ranks: every rule it checks, the degrees' product among them.
        world_size = simulated.world_size
        try:
            dims = ParallelDims.resolve(config, world_size)
        except ConfigError as error:  # its "launched" is the simulated launch: say so
            raise ConfigError(f"{error} (Simulated: {world_size} ranks given by --world-size.)") from None
    else:
        world_size = detect_launch().world_size
        dims = _degrees_for_this_launch(config, world_size)
    check_family_supports(config, vocab_size, registry, dims)  # the layout against what the model declares
    BatchRamp.check(config, dims.dp_size)  # [train.batch_ramp] against the data-parallel ranks
    # Offloading's rules on the layout hold for a launch whose ranks are known (this one under
    # torchrun, or the simulated one); outside torchrun the config is for a launch not made yet.
    launched = dims if simulated.world_size is not None or world_size > 1 else None
    if simulated.device_memory_gib is not None:
        check_offload(config, _meant_device(config), launched)
        return _simulated_report(config, registry, vocab_size, dims, simulated, world_size) + vocab_note
    try:
        device = resolve_device(config.train.device)
    except ConfigError as exc:  # the config may be meant for another machine
        meant = _meant_device(config)
        check_offload(config, meant, launched)
        autocast = autocast_dtype(config.train.precision, meant)
        estimate = estimate_memory(config, vocab_size, registry, dims, autocast, meant)
        return f"estimate: {estimate.describe()}; not checked against a device here: {exc}" + vocab_note
    check_offload(config, device, launched)
    autocast = autocast_dtype(config.train.precision, device)
    # Ranks of a simulated launch share this host, as under torchrun --nproc-per-node.
    sharing = simulated.world_size if simulated.world_size is not None else ranks_on_host()
    limit = memory_limit(device, processes_on_host=sharing if device.type == "cpu" else 1)
    estimate = estimate_memory(config, vocab_size, registry, dims, autocast, device)
    suffix = (" " + simulated.describe(world_size, device) if simulated.world_size is not None else "") + vocab_note
    report = _checked(config, estimate, limit, f"the memory of {device} is unknown here")
    if estimate.host:  # offloaded: the host's share against this host's memory, split among its ranks
        report += _host_checked(config, estimate, host_memory_limit(sharing))
    return report + suffix


def _host_checked(config: ForgeConfig, estimate: MemoryEstimate, limit: MemoryLimit | None) -> str:
    """The host's line of the report of an offloading run; raises the refusal where its share
    does not fit and ``[train] memory_check`` is on."""
    if limit is None:
        return " Host: its memory is unknown here."
    problem = host_shortfall(estimate, limit)
    if problem is not None and config.train.memory_check:
        raise ConfigError(problem)
    more = "more than " if problem is not None else ""
    unchecked = " ([train] memory_check = false)" if problem is not None else ""
    return f" Host: {more}{format_bytes(limit.bytes)} {limit.source}{unchecked}."


def _degrees_for_this_launch(config: ForgeConfig, world_size: int) -> ParallelDims:
    """The degrees on this launch's ranks, checked against the model and the batch but not
    against the world size: a config validated outside torchrun is for a launch not made yet."""
    section = config.distributed
    dp_shard = section.dp_shard
    if dp_shard == -1:
        fixed = section.dp_replicate * section.tp * section.pp * section.cp
        dp_shard = max(1, world_size // fixed)
    dims = ParallelDims(
        section.dp_replicate, dp_shard, section.tp, section.pp, section.ep, section.pp_schedule, cp=section.cp
    )
    # The rules tying the degrees to the model and the batch, as a launch would check them; with
    # dp_shard = -1 the launch picks a dp_shard that ep divides.
    attrs.evolve(dims, dp_shard=dp_shard * section.ep if section.dp_shard == -1 else dp_shard).check(config)
    return dims


def _meant_device(config: ForgeConfig) -> torch.device:
    """The kind of device the config asks for, without looking for it on this machine."""
    return torch.device("cpu" if config.train.device == "cpu" else "cuda")


def _vocab_size(config: ForgeConfig, simulated: SimulatedLaunch) -> tuple[int, str]:
    """The model's vocabulary and a note for the report. A simulated launch is for another
    machine, whose tokenizer file may not be here: where it cannot be read and ``[model]
    vocab_size`` is set, the estimate takes that size and the report says the tokenizer was not
    read. Otherwise the tokenizer is read, as ``forge train`` would."""
    set_size = getattr(model_options(config), "vocab_size", None)
    try:
        tokenizer = config.tokenizer.build()
    except ForgeError as error:
        if simulated == SimulatedLaunch() or not isinstance(set_size, int):
            raise
        reason = " ".join(str(error).split()).rstrip(".")
        return set_size, f" The tokenizer was not read here ({reason}); the estimate takes [model] vocab_size."
    return model_vocab_size(config, tokenizer), ""


def _simulated_report(
    config: ForgeConfig, registry: Any, vocab_size: int, dims: ParallelDims, simulated: SimulatedLaunch, world: int
) -> str:
    """The estimate per device of the simulated machine against its given memory."""
    device = _meant_device(config)
    autocast = autocast_dtype(config.train.precision, device)
    estimate = estimate_memory(config, vocab_size, registry, dims, autocast, device)
    gib = simulated.device_memory_gib
    limit = MemoryLimit(int(gib * GIB), f"({gib:g} GiB) per {_device_word(device)} given by --device-memory-gib")
    note = simulated.describe(world, device)
    try:
        report = _checked(config, estimate, limit, "")
    except ConfigError as refused:
        short = format_bytes(estimate.total - limit.bytes)
        raise ConfigError(f"{refused} {note[:-1]}: {short} short per {_device_word(device)}.") from None
    spare = format_bytes(limit.bytes - estimate.total) if estimate.total <= limit.bytes else None
    return report[:-1] + (f", {spare} to spare. " if spare else ". ") + note


def _checked(config: ForgeConfig, estimate: MemoryEstimate, limit: MemoryLimit | None, unknown: str) -> str:
    """The report of ``estimate`` against ``limit``; raises the refusal where it does not fit
    and ``[train] memory_check`` is on."""
    if limit is None:
        return f"estimate: {estimate.describe()}; {unknown}."
    if estimate.total > limit.bytes:
        if config.train.memory_check:
            raise ConfigError(refusal(estimate, limit))
        limit_text = f"{format_bytes(limit.bytes)} {limit.source}"
        return f"estimate: {estimate.describe()}; more than the {limit_text} ([train] memory_check = false)."
    return f"estimate: {estimate.describe()}; {format_bytes(limit.bytes)} {limit.source}."
