"""forge-lm-eval passes the conformance kit's checks, as any third-party plugin would: its
packaging, and its evaluator's options round trip through a config table."""

from forge_lm.plugins import PluginManager
from forge_lm.testing import parametrize_with_checks


@parametrize_with_checks(
    [
        (
            "evaluators",
            "lm_eval",
            {"options": {"tasks": ["hellaswag", "mine.yaml"], "limit": 5, "every": 2, "include_path": ["tasks"]}},
        )
    ],
    distributions=["forge-lm-eval"],
)
def test_forge_lm_eval_conforms(check):
    check()


def test_forge_lm_eval_is_listed_as_an_ok_plugin_registering_the_lm_eval_evaluator():
    plugin = PluginManager().plugin("lm_eval")
    assert (plugin.distribution, plugin.version, plugin.status) == ("forge-lm-eval", "0.1.0", "ok")
    assert plugin.components == {"evaluators": ["lm_eval"]}
