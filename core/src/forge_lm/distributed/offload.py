"""Offloading to host memory: ``[distributed] cpu_offload`` and ``[train] activation_offload``.

``cpu_offload`` hands FSDP2 a ``CPUOffloadPolicy``: every rank's shards of the parameters, their
gradients and (since the optimizer is built on those parameters) the optimizer state live in
pinned host memory, and the optimizer step runs on the CPU. Each FSDP2 unit copies its shards to
the device just before its all-gather and its reduced gradients back after the reduce-scatter,
so the device holds the units being computed (the root's parameters, a block and the one
prefetched), the buffers and the activations. It trades device memory for PCIe traffic and a
CPU optimizer step: ZeRO-Offload's bargain. Collectives over host tensors (the gradient norm of
host shards, the checkpoint's finiteness count) take the process group's gloo backend beside
NCCL (:func:`forge_lm.distributed.launch.backend_for`).

``activation_offload`` runs the forward under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``:
each tensor autograd saves for the backward is copied to pinned host memory and copied back
when the backward needs it. The backward runs outside it, so what activation checkpointing
recomputes there stays on the device (it is used at once). Combined with checkpointing, only
what checkpointing keeps is offloaded: ``torch.utils.checkpoint`` (non-reentrant) saves a
block's inputs through autograd's saved-tensor hooks, which ``save_on_cpu`` is, and keeps
nothing else of the block; with ``selective``, the operator outputs it keeps are held in its
own cache, outside those hooks, and stay on the device. Outside the blocks (the embedding, the
final norm, the head and the loss) whatever autograd saves is offloaded too.

Both need a CUDA device (on CPU there is nothing to offload to); ``cpu_offload`` also needs
FSDP2 to be sharding (more than one data-parallel or context-parallel rank). Either missing is a
:class:`~forge_lm.errors.ConfigError` from :func:`check_offload`, which ``forge config validate``
and ``forge train`` call once the device is known.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from forge_lm.config import ForgeConfig
from forge_lm.errors import ConfigError


def check_offload(config: ForgeConfig, device: torch.device, dims: Any | None = None) -> None:
    """Refuse offloading the run cannot do on ``device`` (and, when known, the layout ``dims``):
    a :class:`ConfigError` naming the setting and what to change."""
    if device.type != "cuda":
        for on, setting in (
            (config.distributed.cpu_offload, "[distributed] cpu_offload"),
            (config.train.activation_offload, "[train] activation_offload"),
        ):
            if on:
                raise ConfigError(
                    f"{setting} = true moves memory from a GPU to the host, and this run's device is {device.type}: "
                    f"there is nothing to offload to. Set {setting.split('] ')[1]} = false, or train on a GPU "
                    "([train] device = 'cuda')."
                )
    if config.train.activation_offload and dims is not None and dims.pp > 1:
        raise ConfigError(
            f"[train] activation_offload = true with [distributed] pp = {dims.pp}: the pipeline schedule runs each "
            "stage's forward and backward itself, outside the forward that offloading wraps. Set "
            "activation_offload = false (activation_checkpointing saves memory under pp), or pp = 1."
        )
    if config.distributed.cpu_offload and dims is not None and dims.shard_size == 1:
        raise ConfigError(
            "[distributed] cpu_offload = true moves FSDP2's shards to host memory, and this layout does not shard "
            f"the parameters (dp_replicate x dp_shard x cp = 1 of {dims.world_size} rank(s)): launch it under torchrun "
            "with dp_shard >= 2 (FSDP2 runs then), or set cpu_offload = false."
        )


def offload_policy(context: Any) -> OffloadPolicy | None:
    """FSDP2's offload policy for the transform ``context`` (its config and device), or None.
    Pinned host memory makes the copies to and from the GPU asynchronous; a CPU device has none."""
    if not context.config.distributed.cpu_offload:
        return None
    return CPUOffloadPolicy(pin_memory=context.device.type == "cuda")


def saved_activations(config: ForgeConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """Where the forward's saved activations go: pinned host memory with ``[train]
    activation_offload`` on CUDA, else the device (no context)."""
    if config.train.activation_offload and device.type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return contextlib.nullcontext()
