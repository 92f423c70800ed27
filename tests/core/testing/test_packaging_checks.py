"""A packaging mistake in a plugin distribution is a failing kit check with the author's fix
(what to change in the package), not a collection error with the user's (reinstall, remove)."""

from __future__ import annotations

import pytest

from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import parametrize_with_checks

PLUGIN = """
from forge_lm import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl
def forge_lm_register_losses(register):
    register("ghost_loss", "forge_lm.losses.cross_entropy:build_cross_entropy", description="a loss")
"""

USERS_FIX = ("--force-reinstall", "pip uninstall", "--block-plugin")


def _outcomes(mark) -> dict[str, str | None]:
    """Each check of a parametrize mark, run: its id to its failure message (None: it passed)."""
    (checks,) = mark.args[1:]
    outcomes = {}
    for check in checks:
        try:
            check()
        except AssertionError as exc:
            outcomes[check.id] = str(exc)
        else:
            outcomes[check.id] = None
    return outcomes


def _manager(name: str) -> PluginManager:
    return PluginManager(PluginSettings(allow=(name,)))


def test_an_entry_point_naming_a_missing_module_fails_the_kit_with_the_authors_fix(fake_site):
    fake_site.install("forge-ghost", PLUGIN, entry_points={"ghost": "forge_ghost_missing.plugin"})

    # Collecting does not raise (it did: the unknown loss was a PluginError at collection).
    mark = parametrize_with_checks([("losses", "ghost_loss")], ["forge-ghost"], manager=_manager("ghost"))
    outcomes = _outcomes(mark)

    assert outcomes.pop("forge-ghost:declares_forge_lm_entry_points") is None
    assert set(outcomes) == {
        "losses:ghost_loss:is_registered",
        "forge-ghost:entry_points_load",
        "forge-ghost:plugin_modules_import_nothing_heavy",
        "forge-ghost:declared_plugin_api_admits_this_core",
        "forge-ghost:loads_cleanly",
    }
    for check, message in outcomes.items():
        assert message is not None, check
        assert (
            "entry point 'ghost = forge_ghost_missing.plugin' of 'forge-ghost' ([project.entry-points.forge_lm] in its "
            "pyproject.toml) names module 'forge_ghost_missing.plugin', which the installed package does not have"
        ) in message, check
        assert "then reinstall the distribution (pip install -e . in its source tree)" in message
        assert not any(fix in message for fix in USERS_FIX), (check, message)
        assert "Traceback" not in message
    assert outcomes["losses:ghost_loss:is_registered"].startswith(
        "loss 'ghost_loss' is not registered: an installed plugin did not load."
    )


@pytest.mark.parametrize(
    ("source", "entry_point", "expected"),
    [
        (
            "import forge_no_such_dependency\n" + PLUGIN,
            "forge_dep",
            "importing 'forge_dep' needs module 'forge_no_such_dependency', which is not installed. Declare the "
            "distribution that provides it in [project] dependencies",
        ),
        (PLUGIN, "forge_dep:plugin", "names 'plugin' in module 'forge_dep', which has no 'plugin'"),
        ("raise RuntimeError('half-written module')\n", "forge_dep", "raised RuntimeError: half-written module"),
    ],
    ids=["missing-dependency", "missing-attribute", "raising-module"],
)
def test_other_packaging_mistakes_are_named_for_the_author(fake_site, source, entry_point, expected):
    fake_site.install("forge-dep", source, entry_points={"dep": entry_point})

    outcomes = _outcomes(parametrize_with_checks(distributions=["forge-dep"], manager=_manager("dep")))

    message = outcomes["forge-dep:entry_points_load"]
    assert message is not None
    assert message.startswith(f"entry point 'dep = {entry_point}' of 'forge-dep'")
    assert expected in message
    assert outcomes["forge-dep:loads_cleanly"] == message  # not the core's message for users


def test_a_well_packaged_plugin_passes_and_its_component_is_checked(fake_site):
    fake_site.install("forge-fine", PLUGIN, entry_points={"fine": "forge_fine"})

    mark = parametrize_with_checks([("losses", "ghost_loss")], ["forge-fine"], manager=_manager("fine"))
    (checks,) = mark.args[1:]

    ids = [check.id for check in checks]
    assert "losses:ghost_loss:is_registered" not in ids
    assert sum(check_id.startswith("losses:ghost_loss:") for check_id in ids) > 1  # the loss's own checks
    outcomes = _outcomes(parametrize_with_checks(distributions=["forge-fine"], manager=_manager("fine")))
    assert outcomes == dict.fromkeys(outcomes)  # every packaging check passes
