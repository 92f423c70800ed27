"""``forge config reference`` and docs/config-reference.md (issue 36: a user learnt the memmap
dataset's options from an error message): every option of every section and component, read
from the typed configs, and the checked-in file never stale."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from forge_lm.cli._main import main
from forge_lm.config import ForgeConfig
from forge_lm.config._reference import _field_comments, reference_markdown
from forge_lm.plugins import PluginManager, PluginSettings

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "config-reference.md"
FIRST_PARTY = ("moe", "deepseek", "muon", "wandb", "prometheus", "lm_eval", "float8", "vlm")
REGENERATE = f"forge config reference --plugins {','.join(FIRST_PARTY)} > docs/config-reference.md"


@pytest.fixture(scope="module")
def first_party() -> PluginManager:
    return PluginManager(PluginSettings(autoload=False, allow=FIRST_PARTY))


def test_the_checked_in_reference_is_the_generated_one(first_party):
    assert DOC.read_text(encoding="utf-8") == reference_markdown(first_party.registry), (
        f"docs/config-reference.md is stale; regenerate it from the repository's top directory: {REGENERATE}"
    )


def test_every_section_option_and_every_component_is_listed(first_party):
    text = reference_markdown(first_party.registry)
    for section in attrs.fields(ForgeConfig):
        assert f"### [{section.name}]\n" in text
    for field in attrs.fields(type(ForgeConfig().train)):
        assert f"| `{field.name}` |" in text
    for category in ("datasets", "models", "attentions", "feed_forwards", "model_transforms", "evaluators"):
        for component in first_party.registry.components(category):
            assert f"#### `{component.name}` (" in text, component.name
    memmap = text.split("#### `memmap` (core)")[1].split("####")[0]  # what the user had to guess
    assert "| `path` |" in memmap


def test_a_plugin_field_without_a_doc_takes_its_comment():
    source = (
        "class Options:\n"
        "    window: int = attrs.field(default=4096)  # keys a query sees\n"
        "    spread: float = attrs.field(\n"
        "        default=1.0,  # not this one: a later line inside the call\n"
        "    )  # how wide\n"
        "    mode: str = attrs.field(  # how to mix\n"
        "        default='a'\n"
        "    )\n"
        "    # The block above a field,\n"
        "    # over two lines.\n"
        "    rate: float = 0.5\n"
        "    # a note about nothing below\n"
        "\n"
        "    plain: int = 3\n"
    )
    assert dict(_field_comments(source)) == {
        "window": "keys a query sees",
        "spread": "how wide",
        "mode": "how to mix",
        "rate": "The block above a field, over two lines.",
    }


def test_the_command_prints_the_reference_of_the_installed_plugins(capsys):
    assert main(["config", "reference", "--no-plugin-autoload"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Configuration reference\n")
    assert "#### `adamw` (core)" in out
    assert "(forge-moe)" not in out  # autoload off: only the core's components


def test_the_command_takes_no_overrides(capsys):
    assert main(["config", "reference", "--train.max_steps=3"]) == 2
    assert "takes no overrides" in capsys.readouterr().err


def test_types_read_the_same_whether_or_not_attrs_resolved_them(first_party):
    """cattrs resolves a class's annotations in place the first time it structures it: the
    reference must not change with the order in which tests (or commands) ran."""
    from forge_lm.config import EvalSection

    before = reference_markdown(first_party.registry)
    attrs.resolve_types(EvalSection)
    attrs.resolve_types(type(ForgeConfig().train))
    assert reference_markdown(first_party.registry) == before
    assert "| `datasets` | `dict[str, EvalSet]` |" in before
