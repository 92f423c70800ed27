"""forge-wandb passes the conformance kit's packaging checks, as any third-party plugin would."""

from forge_lm.plugins import PluginManager
from forge_lm.testing import parametrize_with_checks


@parametrize_with_checks(distributions=["forge-wandb"])
def test_forge_wandb_distribution_is_well_packaged(check):
    check()


def test_forge_wandb_is_listed_as_an_ok_plugin():
    plugin = PluginManager().plugin("wandb")
    assert (plugin.distribution, plugin.status) == ("forge-wandb", "ok")
