"""A freezing transform whose prefix test is inverted: it freezes every parameter, leaving the
optimizer nothing to train."""

from kit_mutant_base import FreezeOptions

from forge_lm.distributed import ModelTransform

CATEGORY = "model_transforms"
EXPECTED_CHECK = "apply_keeps_names_and_leaves_something_to_train"
OPTIONS = FreezeOptions


def factory(options):
    def apply(model, context):
        for name, param in model.named_parameters():
            if not name.startswith(options.prefix) or True:  # bug: a debugging "or True" left in
                param.requires_grad_(False)

    return ModelTransform("adaptation", lambda context: options.enabled, apply)
