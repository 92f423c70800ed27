"""An evaluator that casts the model to bf16 for speed (model.to(torch.bfloat16)): the run
then trains bf16 weights, or dies in the optimizer."""

import torch
from kit_mutant_base import NextTokenAccuracy

CATEGORY = "evaluators"
EXPECTED_CHECK = "leaves_the_model_as_it_found_it"


class Bf16(NextTokenAccuracy):
    def evaluate(self, model, step):
        model.to(torch.bfloat16)  # bug: casts the live weights
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().evaluate(model, step)


def factory(options, context):
    return Bf16(context)
