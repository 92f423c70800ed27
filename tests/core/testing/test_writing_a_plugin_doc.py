"""docs/writing-a-plugin.md's model family and attention layer, run as written: its module
code blocks become the modules they name, its plugin module is loaded into a plugin manager,
and the conformance checks it shows pass."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from forge_lm.testing import check_component
from forge_lm.testing.markdown import code_block, code_blocks

DOC = Path(__file__).resolve().parents[3] / "docs" / "writing-a-plugin.md"
PACKAGE = "forge_tiny_families"


def _modules() -> dict[str, str]:
    """``{module name: source}`` for each Python block opening with ``# forge_tiny_families/<m>.py``."""
    found = {}
    for language, body in code_blocks(DOC.read_text(encoding="utf-8")):
        first = body.splitlines()[0] if body else ""
        if language == "python" and first.startswith(f"# {PACKAGE}/"):
            found[first[2:].removesuffix(".py").replace("/", ".")] = body
    return found


@pytest.fixture
def doc_plugin(manager, monkeypatch):
    """The doc's plugin, its modules importable under the names its factory strings use."""
    monkeypatch.setitem(sys.modules, PACKAGE, types.ModuleType(PACKAGE))
    loaded = {}
    for name, source in _modules().items():
        module = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, module)
        exec(compile(source, f"{DOC}:{name}", "exec"), module.__dict__)
        loaded[name] = module
    info = manager.add_plugin(loaded[f"{PACKAGE}.plugin"], "tiny_families", distribution="forge-tiny-families")
    assert info.status == "ok", info.reason
    return manager


def test_the_doc_shows_the_plugin_the_family_and_the_attention_modules():
    assert sorted(_modules()) == [f"{PACKAGE}.attention", f"{PACKAGE}.model", f"{PACKAGE}.plugin"]


def test_the_doc_family_and_layer_pass_the_checks_the_doc_shows(doc_plugin, monkeypatch):
    """The doc's test module, run with parametrize_with_checks recording what it is given; each
    component is then checked in the manager holding the doc's plugin."""
    import forge_lm.testing

    given = {}

    def recording(components=(), distributions=(), manager=None):
        given["components"] = list(components)
        return lambda test: test

    monkeypatch.setattr(forge_lm.testing, "parametrize_with_checks", recording)
    exec(code_block(DOC, "python", '("attentions", "tempered")'), {})
    components = [(category, name, *rest) for category, name, *rest in given["components"]]
    assert [(c[0], c[1]) for c in components] == [
        ("models", "previous_token"),
        ("models", "soft_capped"),
        ("models", "llama"),
        ("attentions", "tempered"),
    ]
    for category, name, *rest in components:
        check_component(category, name, manager=doc_plugin, **(rest[0] if rest else {}))
