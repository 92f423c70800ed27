"""A model family that applies dropout to its logits with training=True: random in eval mode."""

import torch.nn.functional as F
from kit_mutant_base import TINY_MODEL, llama_options

from forge_lm.model.transformer import Transformer, build_llama

CATEGORY = "models"
EXPECTED_CHECK = "forward_is_deterministic_in_eval_mode"
OPTIONS = llama_options
AIDS = {"options": TINY_MODEL}


class DroppingTransformer(Transformer):
    def forward(self, input_ids, document_ids=None, **kwargs):
        return F.dropout(super().forward(input_ids, document_ids, **kwargs), 0.1, training=True)  # bug


def factory(options, context):
    model = build_llama(options, context)
    model.__class__ = DroppingTransformer  # the family's class, built as the llama family builds it
    return model
