"""A dataset whose read_batch stacks the right samples but never advances: every batch of a run
would be the same one, and a resumed run would read it again."""

import torch
from kit_mutant_base import CountingTokens

CATEGORY = "datasets"
EXPECTED_CHECK = "read_batch_is_the_samples_stacked"


class Stuck(CountingTokens):
    def read_batch(self, size):
        windows = [(self.index + i) * self.context.dp_size + self.context.dp_rank for i in range(size)]
        samples = [self._sample(window) for window in windows]  # bug: self.index is not advanced
        return {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}


def factory(options, context):
    return Stuck(context)
