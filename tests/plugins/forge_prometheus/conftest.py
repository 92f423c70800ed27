"""Fixtures for forge-prometheus: a plugin manager with the plugin, its backend built from a
config table, and a scraper that reads a server's answer as Prometheus itself parses it."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from forge_lm.components import MetricsContext
from forge_lm.config import structure_options
from forge_lm.plugins import PluginManager, PluginSettings


@pytest.fixture(scope="module")
def prometheus_manager() -> PluginManager:
    """The built-ins and forge-prometheus, whatever else is installed."""
    return PluginManager(PluginSettings(autoload=False, allow=("prometheus",)))


def scrape_text(url: str) -> str:
    """What a scrape of ``url`` returns, as text (a connection error raises URLError)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return response.read().decode("utf-8")


def parse(text: str) -> dict[str, float]:
    """``{metric name: value}`` of an exposition; each metric is one sample without labels."""
    values = {}
    for family in text_string_to_metric_families(text):
        assert family.type == "gauge", family
        (sample,) = family.samples
        assert (sample.name, sample.labels) == (family.name, {})
        values[family.name] = sample.value
    return values


@pytest.fixture(scope="session")
def scrape() -> Callable[[str], dict[str, float]]:
    """Scrape a URL: ``{metric name: value}``."""
    return lambda url: parse(scrape_text(url))


@pytest.fixture(scope="session")
def scrape_raw() -> Callable[[str], str]:
    """Scrape a URL: the text of the answer."""
    return scrape_text


@pytest.fixture(scope="session")
def parse_exposition() -> Callable[[str], dict[str, float]]:
    """Parse an exposition text: ``{metric name: value}``, in the order it lists them."""
    return parse


@pytest.fixture
def build_backend(prometheus_manager, tmp_path) -> Callable[..., object]:
    """Build the backend from a ``[metrics.prometheus]`` table (port 0 unless given); every
    backend built is finished at the end of the test, so no server outlives it."""
    built = []

    def build(**table):
        component = prometheus_manager.registry.resolve("metrics_backends", "prometheus")
        options = structure_options(prometheus_manager.registry, component, {"port": 0, **table}, "metrics.prometheus")
        backend = component.build(options, MetricsContext(run_dir=Path(tmp_path) / "run", run_name="run"))
        built.append(backend)
        return backend

    yield build
    for backend in built:
        backend.finish({})
