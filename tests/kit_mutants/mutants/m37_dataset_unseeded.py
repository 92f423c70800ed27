"""A dataset that draws tokens from torch's global generator: two builds differ."""

import torch
from kit_mutant_base import CountingTokens

CATEGORY = "datasets"
EXPECTED_CHECK = "is_reproducible"


class Unseeded(CountingTokens):
    def _sample(self, index):
        ids = torch.randint(0, self.context.vocab_size, (self.context.seq_len + 1,))  # bug: no generator
        return {"input_ids": ids[:-1], "labels": ids[1:]}


def factory(options, context):
    return Unseeded(context)
