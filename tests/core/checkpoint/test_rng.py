"""Random generator states in a checkpoint: this rank's own GPU only, so that a run resumes
where another number of GPUs is visible (``torch.cuda`` is faked: this machine has none)."""

from __future__ import annotations

import pytest
import torch

from forge_lm.checkpoint._rng import restore_rng, rng_state
from forge_lm.checkpoint._state import check_trainer_state


class FakeCuda:
    """A node with ``count`` GPUs, each with its own generator state, this process on ``current``."""

    def __init__(self, count: int, current: int) -> None:
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(count)}
        self.current = current

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: len(self.states))
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "get_rng_state", lambda device="cuda": self.states[self._index(device)].clone())
        monkeypatch.setattr(cuda, "set_rng_state", self._set)
        monkeypatch.setattr(cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's state was read"))
        monkeypatch.setattr(cuda, "set_rng_state_all", lambda states: pytest.fail("every GPU's state was set"))

    def _index(self, device: object) -> int:
        return device if isinstance(device, int) else torch.device(device).index or 0

    def _set(self, state: torch.Tensor, device: object = "cuda") -> None:
        if self._index(device) >= len(self.states):
            raise RuntimeError("invalid device ordinal")
        self.states[self._index(device)] = state.clone()


def test_only_this_ranks_gpu_generator_is_saved(monkeypatch):
    FakeCuda(count=8, current=3).install(monkeypatch)
    state = rng_state()
    assert state["cuda_device"] == [3] * 16
    assert "cuda" not in state


def test_a_state_saved_with_eight_gpus_restores_where_one_is_visible(monkeypatch):
    saving = FakeCuda(count=8, current=5)
    saving.install(monkeypatch)
    state = rng_state()
    resuming = FakeCuda(count=1, current=0)
    resuming.install(monkeypatch)
    restore_rng(state)
    assert resuming.states[0].tolist() == [5] * 16  # the saving rank's stream goes on here


def test_an_earlier_checkpoints_every_gpu_list_passes_the_checks_and_is_not_restored(monkeypatch):
    resuming = FakeCuda(count=1, current=0)
    resuming.install(monkeypatch)
    state = rng_state()
    del state["cuda_device"]
    state["cuda"] = [[7] * 16 for _ in range(8)]  # the old format: one entry per visible GPU
    check_trainer_state({"step": 1, "model": {}, "optimizer": {}, "trainer": {}, "rng": state}, 1)
    restore_rng(state)
    assert resuming.states[0].tolist() == [0] * 16
