"""The mixture dataset: temperature-scaled weights, phases, and an exactly resumable state."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import attrs
import pytest
import torch

from forge_lm.components import DataContext
from forge_lm.config import load_config, structure_options
from forge_lm.errors import ConfigError, PluginError
from forge_lm.plugins import Component, PluginInfo, Registry


@attrs.define
class ConstantOptions:
    value: int = 0


class Constant:
    """A source whose samples are all ``value``, numbered by how many it has given."""

    def __init__(self, options: ConstantOptions, context: DataContext) -> None:
        self.value, self.seq_len, self.given = options.value, context.seq_len, 0

    def __iter__(self):
        while True:
            self.given += 1
            yield {
                "input_ids": torch.full((self.seq_len,), self.value),
                "labels": torch.full((self.seq_len,), self.given),  # tells samples of a source apart
            }

    def state_dict(self) -> dict[str, Any]:
        return {"given": self.given}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.given = state["given"]


@pytest.fixture
def registry(manager) -> Registry:
    registry = Registry()
    registry.add(manager.registry.resolve("datasets", "mixture"))
    plugin = PluginInfo("test", "test-dist", "1.0", "tests")
    registry.add(Component("datasets", "constant", Constant, ConstantOptions, "", plugin))
    return registry


def mixture(registry: Registry, seed: int = 0, **table: Any):
    component = registry.resolve("datasets", "mixture")
    table.setdefault("sources", [{"name": "constant", "value": 0}, {"name": "constant", "value": 1}])
    options = structure_options(registry, component, table, "data")
    return component.build(options, DataContext(seq_len=3, vocab_size=10, seed=seed, registry=registry))


def sources_of(dataset, count: int) -> list[int]:
    iterator = iter(dataset)
    return [int(next(iterator)["input_ids"][0]) for _ in range(count)]


@pytest.mark.parametrize(
    ("weights", "temperature", "expected"),
    [
        ([3.0, 1.0], 1.0, [0.75, 0.25]),
        ([3.0, 1.0], 2.0, [math.sqrt(3) / (math.sqrt(3) + 1), 1 / (math.sqrt(3) + 1)]),  # 0.634, 0.366
        ([9.0, 1.0], 0.5, [81 / 82, 1 / 82]),
        ([1.0, 1.0], 1.0, [0.5, 0.5]),
    ],
)
def test_source_frequencies_match_the_temperature_scaled_weights(registry, weights, temperature, expected):
    draws = 20_000
    counts = Counter(sources_of(mixture(registry, weights=weights, temperature=temperature), draws))
    for source, p in enumerate(expected):
        sigma = math.sqrt(draws * p * (1 - p))
        assert abs(counts[source] - draws * p) < 5 * sigma + 1, (counts, expected)


def test_empty_weights_mean_equal_weights(registry):
    counts = Counter(sources_of(mixture(registry, sources=[{"name": "constant", "value": v} for v in range(4)]), 8000))
    assert all(abs(counts[v] - 2000) < 5 * math.sqrt(8000 * 0.25 * 0.75) for v in range(4)), counts


def test_phases_switch_the_weights_after_their_sample_count(registry):
    phases = [{"until_sample": 100, "weights": [1.0, 0.0]}, {"until_sample": 150, "weights": [0.0, 1.0]}]
    drawn = sources_of(mixture(registry, weights=[1.0, 1.0], phases=phases), 1100)
    assert set(drawn[:100]) == {0}
    assert set(drawn[100:150]) == {1}
    assert abs(drawn[150:].count(0) - 475) < 5 * math.sqrt(950 * 0.25)  # 50/50 after the last phase


def test_the_source_sequence_depends_on_the_seed_only(registry):
    assert sources_of(mixture(registry, seed=1), 200) == sources_of(mixture(registry, seed=1), 200)
    assert sources_of(mixture(registry, seed=1), 200) != sources_of(mixture(registry, seed=2), 200)


def test_state_round_trip_continues_with_the_same_sources_and_samples(registry):
    dataset = mixture(registry, weights=[2.0, 1.0])
    iterator = iter(dataset)
    _ = [next(iterator) for _ in range(37)]
    state = dataset.state_dict()
    expected = [next(iterator) for _ in range(25)]
    resumed = mixture(registry, weights=[2.0, 1.0])
    resumed.load_state_dict(state)
    again = iter(resumed)
    for sample in expected:
        other = next(again)
        assert all(torch.equal(sample[key], other[key]) for key in sample)
    counts = Counter(int(sample["input_ids"][0]) for sample in expected)
    assert state["drawn"] == 37
    assert sum(s["given"] for s in state["sources"]) == 37
    assert sum(counts.values()) == 25


def test_samples_without_document_ids_get_zeros(registry):
    sample = next(iter(mixture(registry)))
    assert sample["document_ids"].tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"sources": []}, "sources: a mixture needs at least one source"),
        ({"weights": [1.0]}, "weights: has 1 weights for 2 sources"),
        ({"weights": [0.0, 0.0]}, "weights must be >= 0 with at least one > 0"),
        ({"temperature": 0.0}, "temperature: must be > 0"),
        (
            {"phases": [{"until_sample": 5, "weights": [1.0, 1.0]}, {"until_sample": 5, "weights": [1.0, 1.0]}]},
            "until_sample must increase",
        ),
        ({"phases": [{"until_sample": 5, "weights": [1.0]}]}, "phases\\[0\\].weights: has 1 weights for 2 sources"),
    ],
)
def test_invalid_mixture_options_are_config_errors(registry, table, message):
    with pytest.raises(ConfigError, match=message):
        mixture(registry, **table)


def test_a_mixture_is_configured_with_arrays_of_source_tables(tmp_path, manager):
    path = tmp_path / "run.toml"
    path.write_text(
        "[data]\nname = 'mixture'\nweights = [3.0, 1.0]\ntemperature = 2.0\n"
        "phases = [{until_sample = 10, weights = [1.0, 0.0]}]\n"
        "[[data.sources]]\nname = 'python_stdlib'\neval_fraction = 0.1\n"
        "[[data.sources]]\nname = 'synthetic'\n"
    )
    config = load_config(path, ["--data.temperature=4"], manager.registry)
    options = config.data.options
    assert [source.name for source in options.sources] == ["python_stdlib", "synthetic"]
    assert options.sources[0].options.eval_fraction == 0.1
    assert options.temperature == 4.0
    assert options.phases[0].until_sample == 10


def test_a_source_that_fails_to_build_is_named_in_the_error(registry):
    """The source's own crash, reported under its name and plugin (as a dataset chosen directly
    would be), not as the mixture's."""

    def broken(options, context):
        raise ValueError("no shards under /data/missing")

    plugin = PluginInfo("thirdparty", "thirdparty-data", "2.0", "tests")
    registry.add(Component("datasets", "broken_source", broken, ConstantOptions, "", plugin))
    with pytest.raises(PluginError) as info:
        mixture(registry, sources=[{"name": "constant"}, {"name": "broken_source"}])
    message = str(info.value)
    assert message.startswith("dataset 'broken_source' from ")
    assert "thirdparty-data" in message
    assert "no shards under /data/missing" in message
