"""A dataset that yields int32 ids (read from a uint16 file through numpy), not torch.long."""

import torch
from kit_mutant_base import CountingTokens

CATEGORY = "datasets"
EXPECTED_CHECK = "samples_have_the_documented_form"


class Int32(CountingTokens):
    def _sample(self, index):
        sample = super()._sample(index)
        return {key: value.to(torch.int32) for key, value in sample.items()}  # bug


def factory(options, context):
    return Int32(context)
