"""Helpers for the data tests: build a registered dataset from a config table and a context."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from forge_lm.components import DataContext
from forge_lm.config import structure_options
from forge_lm.plugins import PluginManager
from forge_lm.tokenizers.byte_level import ByteTokenizer


def _byte_context(**changes: Any) -> DataContext:
    settings = {"seq_len": 16, "vocab_size": 257, "seed": 3, "tokenizer": ByteTokenizer(), **changes}
    return DataContext(**settings)


def _take(iterable: Any, count: int) -> list[Any]:
    return list(itertools.islice(iter(iterable), count))


@pytest.fixture
def byte_context() -> Callable[..., DataContext]:
    """``byte_context(**changes)``: a context for text datasets, with the byte tokenizer and
    its vocabulary (257 ids, eos = 256)."""
    return _byte_context


@pytest.fixture
def take() -> Callable[[Any, int], list[Any]]:
    """``take(iterable, count)``: the first ``count`` items of a fresh iterator."""
    return _take


@pytest.fixture
def build_dataset(manager: PluginManager) -> Callable[..., Any]:
    """``build_dataset(name, table, context)``: the dataset, its options validated as in a config."""

    def build(name: str, table: dict[str, Any], context: DataContext) -> Any:
        component = manager.registry.resolve("datasets", name)
        options = structure_options(manager.registry, component, table, "data")
        if context.registry is None:
            import attrs

            context = attrs.evolve(context, registry=manager.registry)
        return component.build(options, context)

    return build
