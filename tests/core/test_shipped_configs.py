"""Every config shipped in configs/ is valid with the built-in components."""

from pathlib import Path

import pytest

from forge_lm.config import load_config, to_toml

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


def test_configs_directory_is_not_empty():
    assert CONFIGS, "configs/ holds no TOML files"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_valid_and_round_trips(path, manager, tmp_path):
    config = load_config(path, [], manager.registry)
    again = tmp_path / "again.toml"
    again.write_text(to_toml(config))
    assert load_config(again, [], manager.registry) == config
