"""A transform whose enabled() returns its options' prefix (a truthy string), not a bool."""

from kit_mutant_base import FreezeOptions

from forge_lm.distributed import ModelTransform

CATEGORY = "model_transforms"
EXPECTED_CHECK = "enabled_answers_a_bool"
OPTIONS = FreezeOptions


def factory(options):
    return ModelTransform("adaptation", lambda context: options.enabled and options.prefix, lambda model, context: None)
