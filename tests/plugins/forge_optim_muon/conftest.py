"""Fixtures of forge-optim-muon's tests: the tiny mixture model module, loaded by path."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

HERE = Path(__file__).resolve().parent


def _load_models() -> ModuleType:
    name = "forge_optim_muon_test_models"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "_models.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def models() -> ModuleType:
    """``_models.py``: ``tiny_mixture_lm()``, ``batches()``, ``train()``, ``muon_options()``."""
    return _load_models()


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """These tests use tiny tensors: one thread is fastest, and does not slow to a crawl when
    other processes keep the cores busy (OpenMP threads spin-waiting for each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
