"""A model family with a logit bias drawn with torch.randn in its factory, outside the
Initializer: the seed does not decide it and a meta-device build loses it."""

import torch
from kit_mutant_base import TINY_MODEL, llama_options

from forge_lm.model.transformer import Transformer, build_llama

CATEGORY = "models"
EXPECTED_CHECK = "initial_weights_depend_on_the_seed_only"
OPTIONS = llama_options
AIDS = {"options": TINY_MODEL}


class BiasedTransformer(Transformer):
    def forward(self, input_ids, document_ids=None, **kwargs):
        return super().forward(input_ids, document_ids, **kwargs) + self.logit_bias


def factory(options, context):
    model = build_llama(options, context)
    model.__class__ = BiasedTransformer
    model.register_buffer("logit_bias", torch.randn(context.vocab_size) * 0.01)  # bug: not through the Initializer
    return model
