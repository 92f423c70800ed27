"""A LoRA transform registered in a slot named 'lora', which the core does not have."""

from kit_mutant_base import FreezeOptions

from forge_lm.distributed import ModelTransform

CATEGORY = "model_transforms"
EXPECTED_CHECK = "is_a_model_transform_in_a_known_slot"
OPTIONS = FreezeOptions


def factory(options):
    return ModelTransform("lora", lambda context: options.enabled, lambda model, context: None)
