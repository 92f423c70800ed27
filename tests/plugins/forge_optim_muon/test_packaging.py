"""forge-optim-muon passes the conformance kit's packaging checks, as any third-party plugin would."""

from forge_lm.plugins import PluginManager
from forge_lm.testing import parametrize_with_checks


@parametrize_with_checks(distributions=["forge-optim-muon"])
def test_forge_optim_muon_distribution_is_well_packaged(check):
    check()


def test_forge_optim_muon_is_listed_as_an_ok_plugin():
    plugin = PluginManager().plugin("muon")
    assert (plugin.distribution, plugin.status) == ("forge-optim-muon", "ok")
