"""A dataset whose load_state_dict does nothing: a resumed run reads its data from the start."""

from kit_mutant_base import CountingTokens

CATEGORY = "datasets"
EXPECTED_CHECK = "state_round_trip_restores_the_next_sample"


class Amnesiac(CountingTokens):
    def load_state_dict(self, state):
        pass  # bug


def factory(options, context):
    return Amnesiac(context)
