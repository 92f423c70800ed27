"""The device a run computes on, and what Forge sets up before CUDA first allocates."""

from __future__ import annotations

import os

import pytest
import torch

from forge_lm.errors import ConfigError
from forge_lm.train.device import (
    ALLOCATOR_DEFAULT,
    ALLOCATOR_VARIABLE,
    NCCL_ERRORS_DEFAULT,
    NCCL_ERRORS_VARIABLE,
    resolve_device,
)


@pytest.fixture
def a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv(ALLOCATOR_VARIABLE, raising=False)
    monkeypatch.delenv(NCCL_ERRORS_VARIABLE, raising=False)


@pytest.mark.parametrize("setting", ["cuda", "auto", "cuda:0"])
def test_a_cuda_run_gets_expandable_segments_before_cuda_allocates(a_gpu, monkeypatch, setting):
    assert resolve_device(setting).type == "cuda"
    assert os.environ[ALLOCATOR_VARIABLE] == ALLOCATOR_DEFAULT
    assert os.environ[NCCL_ERRORS_VARIABLE] == NCCL_ERRORS_DEFAULT == "3"  # a failed collective ends the process


def test_a_users_allocator_and_nccl_settings_are_kept(a_gpu, monkeypatch):
    monkeypatch.setenv(ALLOCATOR_VARIABLE, "max_split_size_mb:128")
    monkeypatch.setenv(NCCL_ERRORS_VARIABLE, "1")
    resolve_device("cuda")
    assert os.environ[ALLOCATOR_VARIABLE] == "max_split_size_mb:128"
    assert os.environ[NCCL_ERRORS_VARIABLE] == "1"


def test_a_cpu_run_leaves_the_allocator_alone(monkeypatch):
    monkeypatch.delenv(ALLOCATOR_VARIABLE, raising=False)
    monkeypatch.delenv(NCCL_ERRORS_VARIABLE, raising=False)
    assert resolve_device("cpu") == torch.device("cpu")
    assert ALLOCATOR_VARIABLE not in os.environ
    assert NCCL_ERRORS_VARIABLE not in os.environ


def test_a_gpu_that_does_not_exist_is_a_config_error(a_gpu):
    with pytest.raises(ConfigError, match=r"\[train\] device: 'cuda:3' does not exist; this machine has 1 GPU"):
        resolve_device("cuda:3")
