"""forge-deepseek's README opens with one table of everything the plugin registers."""

from __future__ import annotations

import re
from pathlib import Path

from forge_lm.plugins._categories import CATEGORIES

README = Path(__file__).resolve().parents[3] / "plugins" / "forge-deepseek" / "README.md"


def test_the_components_table_is_one_table_listing_every_registered_component(deepseek_manager):
    text = README.read_text(encoding="utf-8")
    start = text.index("| category | name | what |")
    table = text[start : text.index("\n\n", start)]  # a blank line would end the Markdown table
    listed = set(re.findall(r"^\| `(\w+)` \| `(\w+)` \|", table, re.MULTILINE))
    registered = {
        (category, component.name)
        for category in CATEGORIES
        for component in deepseek_manager.registry.components(category)
        if component.plugin.name == "deepseek"
    }
    assert listed == registered == {("attentions", "mla"), ("models", "deepseek_v3")}
