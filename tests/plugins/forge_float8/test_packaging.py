"""forge-float8 passes the conformance kit's packaging checks, as any third-party plugin would."""

import importlib.metadata

from forge_lm.plugins import PluginManager
from forge_lm.plugins._hints import FIRST_PARTY, known_provider
from forge_lm.testing import parametrize_with_checks


@parametrize_with_checks(components=[("model_transforms", "float8", {})], distributions=["forge-float8"])
def test_forge_float8_is_well_packaged_and_its_options_round_trip(check):
    check()


def test_forge_float8_is_listed_as_an_ok_plugin_registering_the_float8_transform():
    plugin = PluginManager().plugin("float8")
    assert (plugin.distribution, plugin.version, plugin.status) == ("forge-float8", "0.1.0", "ok")
    assert plugin.components == {"model_transforms": ["float8"]}


def test_the_core_knows_which_package_provides_float8():
    assert known_provider("model_transforms", "float8") == "forge-float8"
    assert "forge-float8" in FIRST_PARTY


def test_the_declared_torchao_range_admits_the_installed_torchao():
    from packaging.requirements import Requirement

    (torchao,) = [Requirement(r) for r in importlib.metadata.requires("forge-float8") if r.startswith("torchao")]
    assert str(torchao.specifier) == "<0.19,>=0.10"
    assert torchao.specifier.contains(importlib.metadata.version("torchao"))
