"""forge-prometheus' README says what the plugin does: its config snippet loads, its options
table is the options class, its messages are the ones printed, its scrape is one the parser reads."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import attrs
import pytest
from prometheus_client.parser import text_string_to_metric_families

from forge_lm.config import load_config
from forge_lm.errors import PluginError
from forge_lm.testing.markdown import code_block, code_blocks
from forge_prometheus.backend import MAX_CONNECTIONS, REQUEST_TIMEOUT_S, metric_name
from forge_prometheus.options import PrometheusOptions

README = Path(__file__).resolve().parents[3] / "plugins" / "forge-prometheus" / "README.md"
TEXT = README.read_text(encoding="utf-8")


def blocks() -> list[tuple[str, str]]:
    return code_blocks(TEXT)


def block(language: str, containing: str) -> str:
    return code_block(TEXT, language, containing)


def readme_scrape() -> str:
    return block("", "# TYPE forge_step gauge")


def test_the_toml_snippet_loads_and_spells_out_the_defaults(prometheus_manager, tmp_path):
    config_file = tmp_path / "run.toml"
    config_file.write_text(block("toml", "[metrics.prometheus]"))

    config = load_config(config_file, [], prometheus_manager.registry)

    assert [backend.name for backend in config.metrics.backends] == ["console", "jsonl", "prometheus"]
    assert config.metrics.backends[2].options == PrometheusOptions()


def test_the_options_table_lists_every_option_with_its_default():
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", TEXT, flags=re.MULTILINE)
    defaults = {field.name: field.default for field in attrs.fields(PrometheusOptions)}
    assert {key: value.strip('"') for key, value in rows} == {key: str(value) for key, value in defaults.items()}


def test_the_printed_line_is_the_one_start_prints(build_backend, capsys):
    backend = build_backend()
    backend.start({}, [])

    printed = capsys.readouterr().err
    assert printed.replace(f":{backend.port}/", ":9464/") == block("", "forge-prometheus: serving")


def test_the_port_in_use_message_is_the_one_forge_train_prints(build_backend):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PluginError) as caught:
            build_backend(port=port)

    shown = block("", "forge: error:")
    assert shown == f"forge: error: {caught.value}\n".replace(f":{port}:", ":9464:")


def test_the_scrape_shown_is_label_free_gauges_named_by_the_rule_from_their_keys():
    families = list(text_string_to_metric_families(readme_scrape()))

    assert families[0].name == "forge_step"
    assert families[0].documentation == "Optimizer step of the last metrics Forge logged"
    for family in families:
        assert family.type == "gauge"
        (sample,) = family.samples
        assert (sample.name, sample.labels) == (family.name, {})
    for family in families[1:]:
        key = re.fullmatch(r"Last value Forge logged for metric '(.+)'", family.documentation).group(1)
        assert family.name == metric_name("forge_", key)


def test_the_names_given_as_examples_follow_the_rule():
    for key, name in re.findall(r"`([\w/]+)` is `(forge_\w+)`", TEXT):
        assert metric_name("forge_", key) == name


def test_the_connection_limits_are_the_ones_the_server_applies():
    prose = " ".join(TEXT.split())  # wherever the lines break
    assert f"at most {MAX_CONNECTIONS} connections at once" in prose
    assert f"nothing for {REQUEST_TIMEOUT_S:g} seconds" in prose
