"""The conformance kit's regression suite: a corpus of broken components (``mutants/``, one
realistic bug each, over every category) that the kit must fail, on the check each names, with
a message naming the component and what it expected; and the good versions
(``kit_mutant_base.GOOD``) that pass every check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from forge_lm.errors import ForgeError
from forge_lm.plugins import CATEGORIES
from forge_lm.plugins._categories import singular
from forge_lm.testing import check_component, component_checks

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # the mutants import kit_mutant_base

import kit_mutant_base as base  # noqa: E402

MUTANTS = sorted((HERE / "mutants").glob("m[0-9]*.py"))


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kit_mutants.{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_corpus_spans_every_category() -> None:
    categories = [_load(path).CATEGORY for path in MUTANTS]
    assert len(MUTANTS) >= 30
    assert set(categories) == set(CATEGORIES) == set(base.GOOD)


@pytest.mark.parametrize("path", MUTANTS, ids=[path.stem for path in MUTANTS])
def test_the_kit_fails_the_mutant_on_its_check(path: Path) -> None:
    mutant = _load(path)
    assert mutant.__doc__, f"{path.name} says what its bug is"
    manager = base.manager_with(mutant.CATEGORY, mutant.factory, base.options_class(getattr(mutant, "OPTIONS", None)))
    aids = {**base.GOOD[mutant.CATEGORY][2], **getattr(mutant, "AIDS", {})}
    checks = {
        check.id.rsplit(":", 1)[1]: check
        for check in component_checks(mutant.CATEGORY, base.NAME, manager=manager, **aids)
    }
    with pytest.raises(AssertionError) as caught:
        checks[mutant.EXPECTED_CHECK]()
    message = str(caught.value)
    assert message.startswith(f"{singular(mutant.CATEGORY)} '{base.NAME}'"), message  # names the component
    assert "expects" in message or "must" in message, message  # and what it expected


@pytest.mark.parametrize("category", sorted(base.GOOD))
def test_the_good_version_passes_every_check(category: str) -> None:
    factory, options, aids = base.GOOD[category]
    manager = base.manager_with(category, factory, base.options_class(options))
    check_component(category, base.NAME, manager=manager, **aids)


@pytest.mark.parametrize(
    ("category", "section"),
    [("feed_forwards", "[model.ffn]"), ("schedulers", "[scheduler]"), ("model_transforms", "[transforms.mutant]")],
)
def test_a_bad_option_is_named_by_the_section_users_write(category: str, section: str) -> None:
    factory, options, _ = base.GOOD[category]
    manager = base.manager_with(category, factory, base.options_class(options))
    check = component_checks(category, base.NAME, manager=manager, options={"no_such_option": 1})[0]
    with pytest.raises(ForgeError) as caught:
        check()
    assert str(caught.value).startswith(f"{section} no_such_option: unknown key"), str(caught.value)
