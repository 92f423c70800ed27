"""An evaluator that calls model.train() when done, as after a training loop: the model is
left in train mode."""

from kit_mutant_base import NextTokenAccuracy

CATEGORY = "evaluators"
EXPECTED_CHECK = "leaves_the_model_as_it_found_it"


class Restoring(NextTokenAccuracy):
    def evaluate(self, model, step):
        model.eval()
        try:
            return super().evaluate(model, step)
        finally:
            model.train()  # bug: it was handed in eval mode


def factory(options, context):
    return Restoring(context)
