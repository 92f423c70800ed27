"""The core's own components pass the conformance kit that third-party plugins use."""

from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import parametrize_with_checks

BUILTINS_ONLY = PluginManager(PluginSettings(autoload=False))


@parametrize_with_checks(
    components=[
        ("optimizers", "adamw"),
        ("schedulers", "constant"),
        ("schedulers", "cosine"),
        ("losses", "cross_entropy"),
        ("datasets", "synthetic"),
        ("metrics_backends", "console"),
        ("metrics_backends", "jsonl"),
        ("tokenizers", "bytes"),
    ],
    manager=BUILTINS_ONLY,
)
def test_builtin_component_honours_its_contract(check):
    check()
