"""``gather_bucket_mb``: the matrices of a step are orthogonalised a bounded group at a time, with
the same numbers as all at once. (The 2-rank gathers themselves: test_fsdp.py.)"""

from __future__ import annotations

import pytest
import torch

from forge_lm.config import load_config
from forge_lm.errors import ConfigError
from forge_lm.plugins import PluginManager
from forge_optim_muon import optimizer as muon_module
from forge_optim_muon.factory import build_muon

SMALL_MB = 0.02  # 20,971 bytes: one stacked expert parameter (18,432) fits, two do not
NEWTON_SCHULZ = muon_module.newton_schulz


def _trained(models, monkeypatch, **options):
    """The tiny model after 3 steps, and the matrices of each Newton-Schulz call."""
    calls = []

    def counting(batch, *args, **kwargs):
        calls.append(batch.shape[0])
        return NEWTON_SCHULZ(batch, *args, **kwargs)

    monkeypatch.setattr(muon_module, "newton_schulz", counting)
    model = models.tiny_mixture_lm()
    models.train(model, build_muon(models.muon_options(ns_dtype="float32", **options), model), models.batches(3))
    return model, calls


def test_a_small_budget_cuts_the_batches_and_changes_no_bit(models, monkeypatch):
    whole, whole_calls = _trained(models, monkeypatch)
    cut, cut_calls = _trained(models, monkeypatch, gather_bucket_mb=SMALL_MB)
    # Per step: one batch of each shape (6 of 48x32, 6 of 32x48, 2 of 32x32) against 5 groups, the
    # stacked experts one layer at a time (3 matrices of 6 KiB: 18 KiB a layer, 36 KiB a shape).
    assert whole_calls == [6, 6, 2] * 3
    assert cut_calls == [3, 3, 3, 3, 2] * 3
    for (name, expected), actual in zip(whole.state_dict().items(), cut.state_dict().values(), strict=True):
        assert torch.equal(actual, expected), f"{name}: the budget changed the result"


def test_a_matrix_above_the_budget_is_a_group_of_its_own(models, monkeypatch):
    _, calls = _trained(models, monkeypatch, gather_bucket_mb=1e-6)  # one byte: below every matrix
    assert calls == [3, 3, 3, 3, 1, 1] * 3  # the 2 hidden matrices apart; a stacked parameter is never split


def test_the_budget_must_be_positive():
    with pytest.raises(ValueError, match="gather_bucket_mb must be a positive number of MiB, got 0"):
        muon_module.Muon([torch.nn.Parameter(torch.zeros(2, 2))], gather_bucket_mb=0)
    with pytest.raises(ConfigError, match="gather_bucket_mb"):
        load_config(None, ["--optimizer.name=muon", "--optimizer.gather_bucket_mb=-1"], PluginManager().registry)
