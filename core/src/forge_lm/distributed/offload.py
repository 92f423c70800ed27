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

``cpu_offload`` runs on one GPU too (DeepSpeed's ZeRO-Offload user): a one-process run with it
joins a process group of its own rank (:func:`forge_lm.distributed.launch.init_one_rank_group`)
and FSDP2 runs over a mesh of that one rank (:func:`fsdp_in_one_process`), as torchtitan does on
one GPU: the "shards" are whole tensors, the all-gather and reduce-scatter copies, and what
offloading moves to the host is the whole model's weights, gradients and optimizer state.

In every layout the model is built on the meta device and its parameters materialized on the
host (:func:`parameters_device`): FSDP2 refuses offloaded parameters created on the GPU, and a
model too large for the GPU is never whole on it. Buffers (the RoPE tables) are not FSDP2's:
they go to the GPU (:func:`buffers_to`).

Both need a CUDA device (on CPU there is nothing to offload to); under ``torchrun`` with more
than one rank ``cpu_offload`` also needs FSDP2 to be sharding (more than one data-parallel or
context-parallel rank: tensor or pipeline parallelism alone has no FSDP2 units to offload).
Either missing is a :class:`~forge_lm.errors.ConfigError` from :func:`check_offload`, which
``forge config validate`` and ``forge train`` call once the device is known.
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
    if config.distributed.cpu_offload and dims is not None and dims.shard_size == 1 and dims.world_size > 1:
        raise ConfigError(
            "[distributed] cpu_offload = true moves FSDP2's shards to host memory, and this layout does not shard "
            f"the parameters (dp_replicate x dp_shard x cp = 1 of {dims.world_size} ranks): set dp_shard >= 2 "
            "(FSDP2 runs then), run it in one process (one GPU offloads the whole model), or set cpu_offload = false."
        )


def fsdp_in_one_process(config: ForgeConfig, dims: Any) -> bool:
    """Whether this run is FSDP2 over a mesh of one rank: ``cpu_offload`` in a one-process run
    (which then needs a process group and a mesh of its own)."""
    return config.distributed.cpu_offload and dims.world_size == 1


def parameters_device(config: ForgeConfig, device: torch.device) -> torch.device:
    """Where a model built on the meta device gets its parameters: the host under ``cpu_offload``
    (FSDP2 wants offloaded shards created there, and pins them at its first forward), else
    ``device``."""
    return torch.device("cpu") if config.distributed.cpu_offload else device


def buffers_to(model: torch.nn.Module, device: torch.device) -> None:
    """Move every buffer of ``model`` to ``device`` (where they stay under ``cpu_offload``: FSDP2
    moves parameters to and from the host, never buffers)."""
    moved: dict[int, torch.Tensor] = {}  # a buffer registered in several modules stays one tensor
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if id(buffer) not in moved:
                moved[id(buffer)] = buffer.to(device)
            module._buffers[name] = moved[id(buffer)]


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
