"""Every config shipped in configs/ is valid with the built-in components."""

from pathlib import Path

import pytest

from forge_lm.config import load_config, to_toml
from forge_lm.plugins import PluginManager

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


def test_configs_directory_is_not_empty():
    assert CONFIGS, "configs/ holds no TOML files"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_valid_and_round_trips(path, tmp_path):
    registry = PluginManager().registry  # shipped configs may use the first-party plugins (moe, muon)
    config = load_config(path, [], registry)
    again = tmp_path / "again.toml"
    again.write_text(to_toml(config))
    assert load_config(again, [], registry) == config
