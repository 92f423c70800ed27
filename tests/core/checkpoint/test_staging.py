"""Async checkpoints copy the state into host buffers kept from one save to the next (pinned
for GPU tensors), and in a distributed run only rank 0, which writes the trainer state,
receives the ranks' skeletons. Every checkpoint still loads back bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from forge_lm.checkpoint import CheckpointManager
from forge_lm.checkpoint._staging import StagingBuffers
from forge_lm.config import load_config
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.testing.distributed import torchrun

WORKER = Path(__file__).parent / "workers" / "async_save_worker.py"
MODEL = [
    *TINY_MODEL,
    "--model.vocab_size=257",
    "--train.batch_size=2",
    "--train.seq_len=16",
    "--eval.interval=0",
    "--data.name=synthetic",
    '--metrics.backends=["jsonl"]',
]


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    inputs = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def tensors_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    found = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        found.update({f"optimizer.{index}.{k}": v.clone() for k, v in state.items()})
    return found


def loaded(checkpoints: CheckpointManager, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    model, optimizer = model_and_optimizer(seed=99)  # other weights: all must come from the checkpoint
    train_step(model, optimizer, seed=99)  # and optimizer state to be overwritten
    state = checkpoints.load(model, optimizer, only=checkpoints.root / f"step_{step}")
    return tensors_of(model, optimizer), state


def assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert torch.equal(actual[key], value), key


def test_consecutive_async_saves_reuse_the_host_buffers_and_load_back_bitwise(tmp_path):
    model, optimizer = model_and_optimizer(seed=0)
    checkpoints = CheckpointManager(tmp_path, async_save=True)
    saved = {}
    for step in (1, 2):
        train_step(model, optimizer, seed=step)
        saved[step] = tensors_of(model, optimizer), torch.arange(6.0) * step
        checkpoints.save(step, model, optimizer, {"extra": saved[step][1]})
        if step == 1:
            first = checkpoints._staging.storage()
    checkpoints.wait()
    assert len(first) == len(tensors_of(model, optimizer)) + 1  # every tensor, and the extra one
    assert checkpoints._staging.storage() == first  # the same memory, refilled
    # A tensor whose shape or dtype changed gets a new buffer; the others keep theirs.
    train_step(model, optimizer, seed=3)
    saved[3] = tensors_of(model, optimizer), torch.arange(10, dtype=torch.int32)
    checkpoints.save(3, model, optimizer, {"extra": saved[3][1]})
    checkpoints.close()
    third = checkpoints._staging.storage()
    for step in (1, 2, 3):  # the first two were written before their buffers were refilled
        tensors, state = loaded(checkpoints, step)
        assert_bitwise(tensors, saved[step][0])
        assert state["extra"].dtype == saved[step][1].dtype
        assert torch.equal(state["extra"], saved[step][1])
    assert saved[1][0]["model.0.weight"].ne(saved[2][0]["model.0.weight"]).any()  # the saves differ
    assert not third  # close() let the buffers go


def test_restaging_reallocates_only_what_changed_shape_or_dtype():
    staging = StagingBuffers()
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5), "c": torch.ones(2)}
    staging.stage(tensors)
    before = staging.storage()
    changed = {"a": torch.randn(3, 4), "b": torch.arange(6), "c": torch.ones(2, dtype=torch.float64)}
    staged = staging.stage(changed)
    after = staging.storage()
    assert after["a"] == before["a"]
    assert after["b"] != before["b"]
    assert after["c"] != before["c"]
    for key, value in changed.items():
        assert staged[key].dtype == value.dtype
        assert torch.equal(staged[key], value)
        assert staged[key].data_ptr() != value.data_ptr()  # a copy, not the live tensor
    staging.stage({"a": torch.randn(3, 4)})
    assert set(staging.storage()) == {"a"}  # buffers of keys that left the state are released


def test_buffers_for_gpu_tensors_are_requested_pinned_and_the_copies_awaited_once(monkeypatch):
    """No CUDA here: the tensors claim to be on a GPU, and torch.empty and synchronize are
    recorded (a pinned allocation itself needs CUDA)."""
    requested, synchronized = [], []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        requested.append(pin_memory)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: synchronized.append(True))
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5)}
    staging = StagingBuffers()
    staging.stage(tensors)
    assert (requested, synchronized) == ([False, False], [])  # CPU tensors: plain memory, nothing to await

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    staged = staging.stage(tensors)
    assert requested == [False, False, True, True]  # pinned now: new buffers, requested pinned
    assert synchronized == [True]  # one wait for all the asynchronous copies
    staging.stage(tensors)
    assert len(requested) == 4
    assert synchronized == [True, True]
    monkeypatch.undo()
    assert all(torch.equal(staged[key], value) for key, value in tensors.items())


@pytest.fixture(scope="module")
def two_rank_saves(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("async-save")
    result = torchrun([str(WORKER), str(out), *MODEL, "--distributed.dp_shard=2"], nproc=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_two_ranks_gather_the_skeletons_to_rank_0_only(two_rank_saves):
    ranks = [json.loads((two_rank_saves / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # Rank 0 received both ranks' skeletons at each of the two saves; rank 1 received nothing.
    assert [len(got) for got in ranks[0]["received"]] == [2, 2]
    assert all(got[0] == got[1] for got in ranks[0]["received"])  # FSDP2: every rank describes the same tensors
    assert ranks[1]["received"] == [None, None]
    assert [r["all_gathers"] for r in ranks] == [0, 0]  # no all-gather of objects while saving
    for result in ranks:
        assert result["sharded"]  # the staged tensors were this rank's shards of DTensors
        assert result["reused"]
        assert result["buffers"] > 0
        assert result["moved"]
        assert result["restored_bitwise"]
        assert (result["step"], result["tokens_seen"]) == (2, 2)


def test_a_two_rank_async_checkpoint_loads_bitwise_in_one_process(two_rank_saves):
    manager = PluginManager(PluginSettings(autoload=False))
    config = load_config(None, MODEL, manager.registry)
    model = build_model(config.model, 257, manager.registry, seed=123)
    optimizer = config.optimizer.build(model)
    state = CheckpointManager(two_rank_saves / "run").load(model, optimizer)
    assert state["step"] == 2  # the newest
    expected = torch.load(two_rank_saves / "expected.pt", weights_only=True)
    assert_bitwise({f"model.{k}": v for k, v in model.state_dict().items()}, expected)
