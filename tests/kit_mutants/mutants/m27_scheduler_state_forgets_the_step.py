"""A scheduler whose state_dict keeps only its base rates: resumed, it starts the warmup again."""

from kit_mutant_base import InverseSqrtOptions, inverse_sqrt

CATEGORY = "schedulers"
EXPECTED_CHECK = "state_dict_round_trip_resumes_exactly"
OPTIONS = InverseSqrtOptions


def factory(options, optimizer, total_steps):
    scheduler = inverse_sqrt(options, optimizer, total_steps)
    scheduler.state_dict = lambda: {"base_lrs": list(scheduler.base_lrs)}  # bug: last_epoch lost
    scheduler.load_state_dict = lambda state: None
    return scheduler
