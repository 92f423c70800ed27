"""The memory estimate with offloading: the device's and the host's shares against the formulas of
``forge_lm.model.memory``'s docstring, the block and root counts against a really built model, and
the refusals (the host's share too large; offloading on a CPU device)."""

from __future__ import annotations

import pytest
import torch

from forge_lm.config import load_config
from forge_lm.distributed.mesh import ParallelDims
from forge_lm.errors import ConfigError
from forge_lm.model import available_memory, build_model
from forge_lm.model.memory import check_memory, count_parameters, estimate_memory
from forge_lm.train.preflight import SimulatedLaunch, validation_report

BYTES = 257  # the byte tokenizer's vocabulary
SMALL = ("--model.dim=64", "--model.n_layers=3", "--model.n_heads=4", "--model.tie_embeddings=false")


def config_of(manager, *overrides: str):
    return load_config(None, [*SMALL, *overrides], manager.registry)


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_the_block_and_root_counts_are_those_of_the_built_model(manager):
    config = config_of(manager)
    model = build_model(config.model, BYTES, manager.registry)
    count = count_parameters(config.model, BYTES, manager.registry)
    assert count.largest_block == max(numel(block) for block in model.blocks())
    assert count.outside_blocks == numel(model) - sum(numel(block) for block in model.blocks())
    assert count.outside_blocks == 2 * BYTES * 64 + 64  # embedding, untied head, final norm


@pytest.mark.parametrize(("autocast", "element"), [(None, 4), (torch.bfloat16, 2)])
def test_cpu_offload_moves_weights_gradients_and_optimizer_state_to_the_host(manager, autocast, element):
    dims = ParallelDims(dp_shard=4, tp=2)
    plain = estimate_memory(config_of(manager), BYTES, manager.registry, dims, autocast)
    offloaded = estimate_memory(
        config_of(manager, "--distributed.cpu_offload=true"), BYTES, manager.registry, dims, autocast
    )
    count = offloaded.count

    # The host: this rank's shards, as without offloading (the buffers stay on the device).
    sharded = count.parameter_bytes / 8
    assert offloaded.host == pytest.approx(4 * sharded)  # weights, gradients, AdamW's 2 states
    assert offloaded.host == pytest.approx(plain.weights - count.buffer_bytes + plain.gradients + plain.optimizer_state)
    # The device: the buffers, the root unit and two blocks gathered (split by tp) with fp32 gradients, the activations.
    working = (count.outside_blocks + 2 * count.largest_block) * (element + 4) / 2
    assert offloaded.working_set == pytest.approx(working)
    assert offloaded.total == pytest.approx(count.buffer_bytes + working + plain.activations)
    assert offloaded.activations == plain.activations
    assert plain.host == 0
    assert not plain.state_offloaded


def test_activation_offload_leaves_one_blocks_activations_and_the_logits_on_the_device(manager):
    dims = ParallelDims()
    plain = estimate_memory(config_of(manager), BYTES, manager.registry, dims, None)
    offloaded = estimate_memory(
        config_of(manager, "--train.activation_offload=true"), BYTES, manager.registry, dims, None
    )
    tokens = 16 * 128
    per_block = 64 * 80  # fp32: dim * (16 * 4 + 16) per token (eager attention unknown: no device given)
    logits = BYTES * (4 + 8)
    assert plain.activations == tokens * (3 * per_block + logits)
    assert offloaded.activations == tokens * (per_block + logits)
    assert offloaded.host == tokens * 3 * per_block
    assert offloaded.weights + offloaded.gradients + offloaded.optimizer_state == pytest.approx(
        plain.weights + plain.gradients + plain.optimizer_state
    )


def test_the_description_names_both_shares(manager):
    config = config_of(manager, "--distributed.cpu_offload=true", "--train.activation_offload=true")
    estimate = estimate_memory(config, BYTES, manager.registry, ParallelDims(dp_shard=2), None)
    text = estimate.describe()
    assert " of device memory per rank (buffers " in text
    assert ", gathered layers " in text
    assert " of host memory per rank (weights " in text
    assert "sharded 2 ways: [distributed] cpu_offload; activations " in text
    assert text.endswith(": [train] activation_offload)")


def _a_cuda_device_with(monkeypatch, free: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")


def test_a_host_share_that_does_not_fit_is_refused_and_the_device_share_is_checked_alone(manager, monkeypatch):
    _a_cuda_device_with(monkeypatch, free=10**12)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    config = config_of(manager, "--distributed.cpu_offload=true")
    dims, cuda = ParallelDims(dp_shard=4), torch.device("cuda", 0)
    estimate = estimate_memory(config, BYTES, manager.registry, dims, torch.bfloat16, cuda)
    monkeypatch.setattr(available_memory, "host_available_memory", lambda: int(4 * estimate.host * 0.9))
    with pytest.raises(ConfigError) as refused:
        check_memory(config, BYTES, manager.registry, dims, cuda, torch.bfloat16)
    message = str(refused.value)
    assert message.startswith("the run offloads about ")
    assert "of available memory on this host, shared by its 4 processes" in message
    assert "[distributed] cpu_offload" in message
    monkeypatch.setattr(available_memory, "host_available_memory", lambda: int(4 * estimate.host * 1.1))
    assert check_memory(config, BYTES, manager.registry, dims, cuda, torch.bfloat16).host == estimate.host


def test_the_device_share_alone_is_held_against_the_device(manager, monkeypatch):
    """16 blocks sharded 4 ways: the device holds 3 of them (root unit, 2 blocks) instead of a
    quarter of all 16 with their optimizer state; a device too small for the one fits the other."""
    overrides = ("--model.n_layers=16", "--train.batch_size=1", "--train.seq_len=16")
    plain, offloaded = config_of(manager, *overrides), config_of(manager, *overrides, "--distributed.cpu_offload=true")
    dims, cuda = ParallelDims(dp_shard=4), torch.device("cuda", 0)
    monkeypatch.setattr(available_memory, "host_available_memory", lambda: 10**12)
    needed = estimate_memory(offloaded, BYTES, manager.registry, dims, torch.bfloat16, cuda).total
    _a_cuda_device_with(monkeypatch, free=int(needed * 1.01))
    assert check_memory(offloaded, BYTES, manager.registry, dims, cuda, torch.bfloat16).total == needed
    with pytest.raises(ConfigError, match=r"^the run needs about .* of free memory on cuda:0 \(NVIDIA Test GPU\)"):
        check_memory(plain, BYTES, manager.registry, dims, cuda, torch.bfloat16)


@pytest.mark.parametrize(
    ("setting", "override"),
    [
        ("[distributed] cpu_offload", "--distributed.cpu_offload=true"),
        ("[train] activation_offload", "--train.activation_offload=true"),
    ],
)
def test_offloading_on_a_cpu_device_is_refused_at_validation(manager, setting, override):
    with pytest.raises(ConfigError) as refused:
        validation_report(config_of(manager, "--train.device=cpu", override), manager.registry)
    assert str(refused.value).startswith(
        f"{setting} = true moves memory from a GPU to the host, and this run's device is cpu"
    )


def test_validation_of_an_offloading_config_for_a_gpu_machine_reports_both_shares(manager):
    config = config_of(manager, "--train.device=cuda", "--distributed.cpu_offload=true")
    report = validation_report(config, manager.registry, SimulatedLaunch(world_size=8, device_memory_gib=16))
    assert " of device memory per rank (buffers " in report
    assert " of host memory per rank (weights " in report
    one_gpu = validation_report(config, manager.registry, SimulatedLaunch(world_size=1, device_memory_gib=16))
    assert " of host memory per rank (weights " in one_gpu  # FSDP2 over one rank offloads the whole model
    unsharded = config_of(manager, "--train.device=cuda", "--distributed.cpu_offload=true", "--distributed.tp=2")
    with pytest.raises(ConfigError, match=r"^\[distributed\] cpu_offload = true moves FSDP2's shards to host memory"):
        validation_report(unsharded, manager.registry, SimulatedLaunch(world_size=2, device_memory_gib=16))
