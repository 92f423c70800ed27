"""A dataset whose batched read forgets the one-token shift between inputs and labels that its
iterator makes: runs through the loader would learn to copy their input."""

import torch
from kit_mutant_base import CountingTokens

CATEGORY = "datasets"
EXPECTED_CHECK = "read_batch_is_the_samples_stacked"


class Unshifted(CountingTokens):
    def read_batch(self, size):
        inputs = []
        for _ in range(size):
            window = self.index * self.context.dp_size + self.context.dp_rank
            self.index += 1
            inputs.append(self._sample(window)["input_ids"])
        ids = torch.stack(inputs)
        return {"input_ids": ids, "labels": ids.clone()}  # bug: labels are the inputs, not the next tokens


def factory(options, context):
    return Unshifted(context)
