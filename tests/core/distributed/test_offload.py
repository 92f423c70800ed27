"""Offloading's wiring, without a GPU: the policy FSDP2 is handed (``fully_shard`` captured with a
CUDA device that is only named), the refusals, and where ``activation_offload`` puts the saved
tensors (``save_on_cpu`` replaced by recording hooks: on a CPU it would only copy CPU to CPU).
The real 2-rank run with offloaded state is in test_offload_ranks.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from forge_lm.config import load_config
from forge_lm.distributed import ParallelDims, TransformContext, fsdp
from forge_lm.distributed.activation_checkpointing import checkpointed
from forge_lm.distributed.offload import check_offload, saved_activations
from forge_lm.errors import ConfigError
from forge_lm.model import build_model
from forge_lm.testing import TINY_MODEL

CUDA = torch.device("cuda", 0)  # a device object only: nothing here touches CUDA


def config_of(manager, *overrides: str):
    return load_config(None, [*TINY_MODEL, "--train.seq_len=16", "--train.batch_size=2", *overrides], manager.registry)


class _Mesh:
    """What ``fsdp._apply`` asks of a submesh when no plugin unit needs a process group."""


def _shard_calls(manager, monkeypatch, *overrides: str) -> list[dict]:
    calls: list[dict] = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kwargs: calls.append({"module": module, **kwargs}))
    config = config_of(manager, *overrides)
    model = build_model(config.model, 257, manager.registry)
    context = TransformContext(config, ParallelDims(dp_shard=2), None, CUDA, torch.bfloat16)
    monkeypatch.setattr(TransformContext, "submesh", lambda self, *names: _Mesh())
    fsdp._apply(model, context)
    assert [call["module"] for call in calls] == [*model.blocks(), model]  # each block, then the root
    return calls


def test_cpu_offload_hands_every_fsdp2_unit_a_pinned_cpu_offload_policy(manager, monkeypatch):
    calls = _shard_calls(manager, monkeypatch, "--distributed.cpu_offload=true")
    for call in calls:
        assert call["offload_policy"] == CPUOffloadPolicy(pin_memory=True)
        assert call["mp_policy"] == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def test_without_cpu_offload_fsdp2_keeps_its_default_policy(manager, monkeypatch):
    for call in _shard_calls(manager, monkeypatch):
        assert "offload_policy" not in call


@pytest.mark.parametrize(
    ("overrides", "dims", "message"),
    [
        (["--distributed.cpu_offload=true"], None, r"^\[distributed\] cpu_offload = true moves memory from a GPU"),
        (["--train.activation_offload=true"], None, r"^\[train\] activation_offload = true moves memory from a GPU"),
    ],
)
def test_offloading_on_a_cpu_is_refused_naming_the_setting(manager, overrides, dims, message):
    with pytest.raises(ConfigError, match=message) as refused:
        check_offload(config_of(manager, *overrides), torch.device("cpu"), dims)
    assert "there is nothing to offload to" in str(refused.value)


def test_cpu_offload_needs_fsdp2_sharding_and_activation_offload_refuses_pp(manager):
    offload = config_of(manager, "--distributed.cpu_offload=true")
    with pytest.raises(ConfigError, match=r"does not shard the parameters \(dp_replicate x dp_shard x cp = 1 of 2"):
        check_offload(offload, CUDA, ParallelDims(dp_shard=1, tp=2))
    check_offload(offload, CUDA, ParallelDims(dp_shard=2))  # sharded: accepted
    check_offload(offload, CUDA, None)  # the launch is not known yet: the layout is not judged
    activations = config_of(manager, "--train.activation_offload=true")
    with pytest.raises(ConfigError, match=r"^\[train\] activation_offload = true with \[distributed\] pp = 2"):
        check_offload(activations, CUDA, ParallelDims(dp_shard=1, pp=2))
    check_offload(activations, CUDA, ParallelDims())


class _Recording(torch.autograd.graph.saved_tensors_hooks):
    """``save_on_cpu``'s place: records what would be offloaded, and whether a backward was running."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory, self.packed, self.in_backward = pin_memory, [], []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self.packed.append(tensor)
            self.in_backward.append(torch._C._current_graph_task_id() != -1)
            return tensor

        super().__init__(pack, lambda tensor: tensor)


def test_activation_offload_uses_pinned_save_on_cpu_on_cuda_only(manager, monkeypatch):
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", _Recording)
    on = config_of(manager, "--train.activation_offload=true")
    context = saved_activations(on, CUDA)
    assert isinstance(context, _Recording)
    assert context.pin_memory
    assert isinstance(saved_activations(on, torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(saved_activations(config_of(manager), CUDA), contextlib.nullcontext)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_with_checkpointing_only_the_block_inputs_are_offloaded_from_the_blocks(manager, mode):
    """Each block's forward under checkpointing, run inside the offloading hooks: of what a block
    saves, the hooks see its inputs (the residual stream, the RoPE tables) and nothing else
    (checkpointing keeps no more, or keeps its selected outputs in its own cache); without
    checkpointing they see every tensor the block saves."""
    config = config_of(manager)
    ids = torch.randint(0, 257, (2, 16))

    def run(checkpointing: str | None):
        model = build_model(config.model, 257, manager.registry)
        recording, arguments = _Recording(), []
        for block in model.blocks():
            forward = checkpointed(block.forward, checkpointing) if checkpointing else block.forward
            block.forward = _inside(recording, forward, arguments)
        model(ids).float().sum().backward()
        return recording, arguments

    plain, _ = run(None)
    kept, arguments = run(mode)
    inputs = [t for t in arguments if isinstance(t, torch.Tensor)]  # x, the RoPE tables, the mask, per block
    assert sorted(id(t) for t in kept.packed) == sorted(id(t) for t in inputs)  # each once, nothing else
    assert len(plain.packed) > 4 * len(kept.packed)
    assert not any(kept.in_backward)  # the recomputation in backward saves outside the hooks


def _inside(recording, forward, arguments):
    def run(*args, **kwargs):
        arguments.extend(args)
        with recording:
            return forward(*args, **kwargs)

    return run


@pytest.mark.slow  # two training runs
def test_the_training_loop_offloads_the_forwards_saved_tensors_and_not_the_backwards(manager, monkeypatch, tmp_path):
    """Two steps of ``train`` with activation_offload and full checkpointing, the CPU standing in
    for the GPU (the refusal is lifted, save_on_cpu records): tensors are offloaded during the
    forward only, and the losses are those of the same run without offloading."""
    import importlib

    from forge_lm.metrics.jsonl import read_metrics
    from forge_lm.train import train

    recordings: list[_Recording] = []
    monkeypatch.setattr(
        torch.autograd.graph, "save_on_cpu", lambda pin_memory: recordings.append(_Recording()) or recordings[-1]
    )
    patched = set()
    for name in ("loop", "parts", "step"):  # wherever the run's build and step import them from
        try:
            module = importlib.import_module(f"forge_lm.train.{name}")
        except ImportError:
            continue
        if hasattr(module, "check_offload"):
            monkeypatch.setattr(module, "check_offload", lambda *args: None)
            patched.add("check_offload")
        if hasattr(module, "saved_activations"):
            monkeypatch.setattr(module, "saved_activations", lambda config, device: saved_activations(config, CUDA))
            patched.add("saved_activations")
    assert patched == {"check_offload", "saved_activations"}
    common = ["--train.max_steps=2", "--eval.interval=0", '--metrics.backends=["jsonl"]', "--metrics.peak_flops=1e12"]
    common += ["--data.name=synthetic", "--train.activation_checkpointing=full", "--checkpoint.interval=0"]
    losses = {}
    for offload in ("false", "true"):
        run_dir = tmp_path / offload
        config = config_of(manager, *common, f"--train.activation_offload={offload}", f"--train.output_dir={run_dir}")
        train(config, manager)
        losses[offload] = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert len(recordings) == 2  # one forward per step
    assert all(recording.packed for recording in recordings)
    assert not any(flag for recording in recordings for flag in recording.in_backward)
    assert losses["true"] == losses["false"]
