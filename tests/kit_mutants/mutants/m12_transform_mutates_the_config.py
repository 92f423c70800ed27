"""A LoRA-like transform that turns gradient clipping off by writing into the run's config."""

from kit_mutant_base import FreezeOptions

from forge_lm.distributed import ModelTransform

CATEGORY = "model_transforms"
EXPECTED_CHECK = "leaves_the_config_unchanged"
OPTIONS = FreezeOptions


def factory(options):
    def apply(model, context):
        object.__setattr__(context.config.train, "grad_clip", 0.0)  # bug: config is read-only

    return ModelTransform("adaptation", lambda context: options.enabled, apply)
