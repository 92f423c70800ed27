"""An evaluator that returns its accuracy as a bare float instead of a mapping."""

from kit_mutant_base import NextTokenAccuracy

CATEGORY = "evaluators"
EXPECTED_CHECK = "returns_a_mapping_of_finite_floats"


class BareFloat(NextTokenAccuracy):
    def evaluate(self, model, step):
        return super().evaluate(model, step)["eval/next_token/accuracy"]  # bug: not a mapping


def factory(options, context):
    return BareFloat(context)
