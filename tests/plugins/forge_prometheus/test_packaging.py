"""forge-prometheus passes the conformance kit's packaging checks, as any third-party plugin would."""

from forge_lm.plugins import PluginManager
from forge_lm.testing import parametrize_with_checks


@parametrize_with_checks(distributions=["forge-prometheus"])
def test_forge_prometheus_distribution_is_well_packaged(check):
    check()


def test_forge_prometheus_is_listed_as_an_ok_plugin_registering_the_prometheus_backend():
    plugin = PluginManager().plugin("prometheus")
    assert (plugin.distribution, plugin.version, plugin.status) == ("forge-prometheus", "0.1.0", "ok")
    assert plugin.components == {"metrics_backends": ["prometheus"]}
