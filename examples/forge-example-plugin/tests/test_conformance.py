"""This plugin's own tests: Forge's conformance kit, plus checks of its own numbers."""

import torch
import torch.nn.functional as F

from forge_example_plugin.csv_backend import read_csv_metrics
from forge_lm.components import IGNORE_INDEX
from forge_lm.testing import parametrize_with_checks


def torch_label_smoothing(logits, labels):
    """The independent reference: torch's own label smoothing (default options: 0.1)."""
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, label_smoothing=0.1
    )


@parametrize_with_checks(
    components=[
        ("losses", "smoothed_cross_entropy", {"reference": torch_label_smoothing}),
        ("metrics_backends", "csv", {"read_back": lambda run_dir, output: read_csv_metrics(run_dir / "metrics.csv")}),
    ],
    distributions=["forge-example-plugin"],
)
def test_conformance(check):
    check()


def test_smoothing_zero_is_plain_cross_entropy():
    from forge_example_plugin.losses import build_smoothed_cross_entropy
    from forge_example_plugin.plugin import SmoothedCrossEntropyOptions

    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    loss = build_smoothed_cross_entropy(SmoothedCrossEntropyOptions(smoothing=0.0))(logits, labels)
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), labels.flatten()))
