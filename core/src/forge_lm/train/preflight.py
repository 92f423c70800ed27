"""``forge config validate``'s look ahead: would ``forge train`` start this config here?

It resolves what a launch would (the tokenizer's vocabulary, the parallel degrees with
``dp_shard = -1`` taking this launch's ranks, the device and its precision), checks the
degrees against the model, and reports the memory estimate of :mod:`forge_lm.model.memory`
against this machine's memory, refusing what ``forge train`` would refuse.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from forge_lm.config import ForgeConfig
from forge_lm.distributed.launch import detect_launch
from forge_lm.distributed.mesh import ParallelDims
from forge_lm.errors import ConfigError
from forge_lm.model.capabilities import check_family_supports
from forge_lm.model.memory import (
    estimate_memory,
    format_bytes,
    memory_limit,
    model_vocab_size,
    processes_on_host,
    refusal,
)
from forge_lm.train.device import autocast_dtype, resolve_device


def validation_report(config: ForgeConfig, registry: Any) -> str:
    """For ``forge config validate``: the estimate, and the device it was checked against, as
    ``forge train`` would run the config here (``dp_shard = -1``: the ranks of this launch, one
    outside ``torchrun``). Raises :class:`ConfigError` where ``forge train`` would refuse it."""
    vocab_size = model_vocab_size(config, config.tokenizer.build())
    section = config.distributed
    dp_shard = section.dp_shard
    if dp_shard == -1:
        fixed = section.dp_replicate * section.tp * section.pp * section.cp
        dp_shard = max(1, detect_launch().world_size // fixed)
    dims = ParallelDims(
        section.dp_replicate, dp_shard, section.tp, section.pp, section.ep, section.pp_schedule, cp=section.cp
    )
    # The rules tying the degrees to the model and the batch, as a launch would check them; with
    # dp_shard = -1 the launch picks a dp_shard that ep divides.
    attrs.evolve(dims, dp_shard=dp_shard * section.ep if section.dp_shard == -1 else dp_shard).check(config)
    check_family_supports(config, vocab_size, registry, dims)  # the layout against what the model declares
    try:
        device = resolve_device(config.train.device)
    except ConfigError as exc:  # the config may be meant for another machine
        meant = torch.device("cuda" if config.train.device.startswith("cuda") else "cpu")
        autocast = autocast_dtype(config.train.precision, meant)
        estimate = estimate_memory(config, vocab_size, registry, dims, autocast, meant)
        return f"estimate: {estimate.describe()}; not checked against a device here: {exc}"
    autocast = autocast_dtype(config.train.precision, device)
    limit = memory_limit(device, processes_on_host=processes_on_host(device))
    estimate = estimate_memory(config, vocab_size, registry, dims, autocast, device)
    if limit is None:
        return f"estimate: {estimate.describe()}; the memory of {device} is unknown here."
    if estimate.total > limit.bytes:
        if config.train.memory_check:
            raise ConfigError(refusal(estimate, limit))
        limit_text = f"{format_bytes(limit.bytes)} {limit.source}"
        return f"estimate: {estimate.describe()}; more than the {limit_text} ([train] memory_check = false)."
    return f"estimate: {estimate.describe()}; {format_bytes(limit.bytes)} {limit.source}."
