"""An evaluator that returns its metric as a 0-d tensor instead of a float."""

from kit_mutant_base import NextTokenAccuracy

CATEGORY = "evaluators"
EXPECTED_CHECK = "returns_a_mapping_of_finite_floats"


class TensorValued(NextTokenAccuracy):
    def evaluate(self, model, step):
        logits = model(self.ids[:, :-1])
        return {"eval/next_token/accuracy": (logits.argmax(-1) == self.ids[:, 1:]).float().mean()}  # bug: no float()


def factory(options, context):
    return TensorValued(context)
