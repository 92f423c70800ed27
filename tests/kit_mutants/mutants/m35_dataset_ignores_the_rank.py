"""A dataset that never reads dp_rank: every data-parallel rank trains on the same windows."""

from kit_mutant_base import CountingTokens

CATEGORY = "datasets"
EXPECTED_CHECK = "data_parallel_ranks_get_distinct_samples"


class SameForAll(CountingTokens):
    def __iter__(self):
        while True:
            self.index += 1
            yield self._sample(self.index - 1)  # bug: no dp_rank / dp_size


def factory(options, context):
    return SameForAll(context)
