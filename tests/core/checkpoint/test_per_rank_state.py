"""A trainer state's per-rank entries (forge_lm.checkpoint.PerRank, PowerSGD's error feedback):
saved under each rank, read back by that rank alone. What a rank asks the checkpoint reader
for is checked here in one process; tests/core/distributed/test_reduce_choices.py checks it in
real 2- and 4-rank resumes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from forge_lm.checkpoint import CheckpointManager, PerRank
from forge_lm.checkpoint import _load as loading
from forge_lm.checkpoint._tree import join, merge_rank_skeletons, own_rank_parts, split, tensor_keys
from forge_lm.distributed.compression import PowerSGD


def _rank_state(rank: int) -> dict:
    return {"tokens_seen": 8, "compression": PerRank({"errors": {"w": torch.full((2, 3), float(rank))}}, rank)}


def test_rank_0s_skeleton_holds_every_ranks_part_and_each_rank_keeps_its_own() -> None:
    saved = [split({"trainer": _rank_state(rank)}, "state") for rank in (0, 1, 2)]
    skeleton = merge_rank_skeletons([skeleton for _, skeleton in saved])  # as rank 0 writes it
    assert sorted(skeleton["trainer"]["compression"]["__rank__"]) == ["0", "1", "2"]
    for rank, (tensors, _) in enumerate(saved):
        own = own_rank_parts(skeleton, rank)
        assert tensor_keys(own) == [f"state.trainer.compression.rank{rank}.errors.w"]
        joined = join(own, tensors)
        assert joined["trainer"]["tokens_seen"] == 8
        assert torch.equal(joined["trainer"]["compression"]["errors"]["w"], torch.full((2, 3), float(rank)))
    assert own_rank_parts(skeleton, 3)["trainer"]["compression"] is None  # a rank the checkpoint never had


@pytest.mark.parametrize(
    "entry",
    [{"__rank__": [1]}, {"__rank__": {"zero": {}}}, {"__rank__": {"0": {}}, "other": 1}, {"__rank__": {"٣": {}}}],
)
def test_a_malformed_per_rank_entry_is_refused(entry: dict) -> None:
    with pytest.raises(ValueError, match="malformed __rank__ entry"):
        own_rank_parts({"trainer": {"compression": entry}}, 0)


class _ReaderRequests:
    """Stands in for the loader's ``dcp`` module, recording the tensors each load asks for."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def load(self, state_dict, **kwargs):
        self.asked += sorted(state_dict)
        return dcp.load(state_dict, **kwargs)


def test_a_resume_asks_the_reader_for_no_other_ranks_part(tmp_path, monkeypatch) -> None:
    """One process saves its own part and one of rank 1's (as if gathered); loading as rank 0,
    the reader is asked for rank 0's tensor only, which comes back bitwise, and rank 1's entry is None."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mine, theirs = torch.randn(3, 2), torch.randn(5, 2)
    state = {"own": PerRank({"error": mine}), "other": PerRank({"error": theirs}, rank=1)}
    CheckpointManager(tmp_path).save(1, model, optimizer, state)
    written = json.loads((tmp_path / "checkpoints" / "step_1" / "trainer_state.json").read_text())
    rank_1s = {"error": {"__tensor__": "state.trainer.other.rank1.error"}}
    assert written["trainer"]["other"] == {"__rank__": {"1": rank_1s}}

    requests = _ReaderRequests()
    monkeypatch.setattr(loading, "dcp", requests)
    fresh = torch.nn.Linear(4, 3)
    loaded = CheckpointManager(tmp_path).load(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    assert torch.equal(loaded["own"]["error"], mine)
    assert loaded["other"] is None
    assert "state.trainer.own.rank0.error" in requests.asked
    assert not [key for key in requests.asked if "rank1" in key]


@pytest.fixture
def one_rank_group():
    """A process group of this process alone (gloo), for a PowerSGD object outside a run."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_powersgd_loads_its_own_state_and_that_of_checkpoints_holding_every_ranks(one_rank_group) -> None:
    saving = PowerSGD(rank=2, warmup_steps=0, error_feedback=True, group=None, seed=0)
    saving.reductions = {"block0": 3}
    saving.errors, saving.factors = {"w": torch.randn(4, 6)}, {"w": torch.randn(6, 2)}
    saved = saving.state_dict()
    # Written by Forge before PerRank: every rank's state in every checkpoint, under "rank<N>".
    for form in (saved, {"rank0": saved, "rank1": {"elsewhere": True}}):
        loading_ = PowerSGD(rank=2, warmup_steps=0, error_feedback=True, group=None, seed=0)
        loading_.reductions = {"block0": 0}
        assert loading_.load_state_dict(form) is None
        assert loading_.reductions == {"block0": 3}
        assert torch.equal(loading_.errors["w"], saving.errors["w"])
        assert torch.equal(loading_.factors["w"], saving.factors["w"])
    fresh = PowerSGD(rank=2, warmup_steps=0, error_feedback=True, group=None, seed=0)
    assert "no compression state for this rank" in fresh.load_state_dict(None)
    assert "no compression state for this rank" in fresh.load_state_dict({"rank1": saved})
    with pytest.raises(ValueError, match="not what Forge writes"):
        fresh.load_state_dict({"errors": {}})
