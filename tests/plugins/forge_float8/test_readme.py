"""forge-float8's README says what the plugin does: its config snippet loads, its options table is
the options class, the lines it shows are the ones printed, its tolerance is the one tested."""

from __future__ import annotations

import re
import tomllib

import attrs
import pytest
import torch

from forge_float8.options import Float8Options
from forge_lm.config import load_config
from forge_lm.distributed import ParallelDims, TransformContext, apply_model_transforms
from forge_lm.model import build_model
from forge_lm.testing.markdown import code_block, code_blocks

from .conftest import (
    DEBUG_CONFIG,
    ODD,
    README,
    REFUSED_FP16,
    REFUSED_ROWWISE_ALL_GATHER,
    REFUSED_TP,
    REPO,
    TOLERANCE,
)

TEXT = README.read_text(encoding="utf-8")


def blocks() -> list[tuple[str, str]]:
    return code_blocks(TEXT)


def block(language: str, containing: str) -> str:
    return code_block(TEXT, language, containing)


def test_the_toml_snippet_loads_and_spells_out_the_defaults_but_enabled(float8_manager, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(block("toml", "[transforms.float8]"))
    config = load_config(path, [], float8_manager.registry)
    assert config.transforms["float8"].options == Float8Options(enabled=True)


def test_the_options_table_lists_every_option_with_its_default():
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", TEXT, flags=re.MULTILINE))
    defaults = attrs.asdict(Float8Options())
    assert {name: tomllib.loads(f"v = {value}")["v"] for name, value in rows.items()} == defaults


@pytest.mark.parametrize(
    ("path", "overrides", "shown"),
    [(DEBUG_CONFIG, [], "14 of 15"), (None, ["--transforms.float8.enabled=true", *ODD], "4 of 8")],
    ids=["float8_debug", "odd-sizes"],
)
def test_the_printed_lines_are_the_ones_the_transform_prints(float8_manager, capsys, path, overrides, shown):
    config = load_config(path, overrides, float8_manager.registry)
    torch.manual_seed(0)
    model = build_model(config.model, 257, float8_manager.registry)
    context = TransformContext(config, ParallelDims(), None, torch.device("cpu"), None)
    apply_model_transforms(model, context, float8_manager.registry)
    assert capsys.readouterr().err == block("", f"forge-float8: {shown} Linear layers")


@pytest.mark.parametrize("message", [REFUSED_ROWWISE_ALL_GATHER, REFUSED_TP, REFUSED_FP16])
def test_the_refusals_shown_are_the_ones_the_plugin_raises(message):
    assert block("", message[:60]) == f"forge: error: {message}\n"


def test_the_stated_tolerance_is_the_tested_one():
    (stated,) = re.findall(r"The tests hold every step within ([\d.]+)% of the fp32 run", TEXT)
    assert float(stated) / 100 == TOLERANCE


def test_the_commands_name_files_that_exist():
    for path in re.findall(r"(configs/\S+\.toml|benchmarks/\S+\.py)", TEXT):
        assert (REPO / path).is_file(), path
