"""forge-lm-eval passes the conformance kit's checks, as any third-party plugin would: its
packaging, its evaluator's options round trip through a config table, and the evaluator
itself keeps the evaluator contract (a mapping of finite numbers; the model's weights and mode
untouched) on the bundled task, which every checkout has."""

from pathlib import Path

from forge_lm.plugins import PluginManager
from forge_lm.testing import parametrize_with_checks

TASK = Path(__file__).resolve().parents[3] / "configs" / "lm_eval" / "python_lines.yaml"


@parametrize_with_checks(
    [("evaluators", "lm_eval", {"options": {"tasks": [str(TASK)], "limit": 4, "every": 2}})],
    distributions=["forge-lm-eval"],
)
def test_forge_lm_eval_conforms(check):
    check()


def test_forge_lm_eval_is_listed_as_an_ok_plugin_registering_the_lm_eval_evaluator():
    plugin = PluginManager().plugin("lm_eval")
    assert (plugin.distribution, plugin.version, plugin.status) == ("forge-lm-eval", "0.1.0", "ok")
    assert plugin.components == {"evaluators": ["lm_eval"]}
