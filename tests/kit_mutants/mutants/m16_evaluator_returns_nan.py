"""An evaluator that divides by the number of examples longer than the context: none, so it
returns 0/0 = NaN."""

from kit_mutant_base import NextTokenAccuracy

CATEGORY = "evaluators"
EXPECTED_CHECK = "returns_a_mapping_of_finite_floats"


class LongExamples(NextTokenAccuracy):
    def evaluate(self, model, step):
        long = [ids for ids in self.ids if len(ids) > 1000]
        right = sum(1 for _ in long)
        return {"eval/long/accuracy": right / len(long) if long else float("nan")}  # bug: undefined returned


def factory(options, context):
    return LongExamples(context)
