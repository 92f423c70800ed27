"""A metrics backend that skips a record json.dumps refuses (allow_nan=False): the step with a
NaN loss is lost."""

import contextlib
import json

from kit_mutant_base import JsonLinesBackend

CATEGORY = "metrics_backends"
EXPECTED_CHECK = "records_what_was_logged"


class Strict(JsonLinesBackend):
    def log(self, step, metrics):
        with contextlib.suppress(ValueError):  # bug: a record with NaN is dropped
            self.records.append(json.dumps({"step": step, **metrics}, allow_nan=False))


def factory(options, context):
    return Strict(context.run_dir)
