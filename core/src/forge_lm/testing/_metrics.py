"""Metrics backend contract: ``factory(options, context: MetricsContext) -> backend`` with
``start(config, manifest)``, ``log(step, metrics)`` and ``finish(summary)``.

Extra: ``read_back=callable(run_dir, output) -> list of (step, metrics)``, reading what the
backend recorded (``output`` is what it printed to standard output), so the kit can check that
what was logged arrived.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import tempfile
from pathlib import Path

from forge_lm.components import MetricsContext
from forge_lm.plugins import CORE_DISTRIBUTION
from forge_lm.testing._kit import Subject, category_check

LOGGED = [
    (1, {"loss": 3.25, "lr": 1e-4}),
    (2, {"loss": 2.5, "lr": 2e-4, "grad_norm": 0.75}),
    (5, {"loss": float("nan"), "lr": 3e-4}),
]


def _run(subject: Subject, run_dir: Path) -> str:
    """Drive the backend through a short run; return what it printed."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        backend = subject.build(MetricsContext(run_dir=run_dir, run_name="conformance"))
        backend.start({"run": {"name": "conformance"}}, [{"name": "core", "distribution": "forge-lm", "version": "0"}])
        for step, metrics in LOGGED:
            backend.log(step, metrics)
        backend.finish({"final_loss": 2.5})
    return output.getvalue()


@category_check("metrics_backends")
def check_writes_nowhere_but_the_run_directory(subject: Subject) -> None:
    with tempfile.TemporaryDirectory() as work:
        previous = os.getcwd()
        os.chdir(work)
        try:
            _run(subject, Path(work) / "run")
        finally:
            os.chdir(previous)
        stray = sorted(p.name for p in Path(work).iterdir() if p.name != "run")
        assert not stray, (
            f"{subject.label} wrote outside the run directory: {stray}; the kit expects nothing but the run "
            "directory in the working directory"
        )


@category_check("metrics_backends")
def check_records_what_was_logged(subject: Subject) -> None:
    read_back = subject.extras.get("read_back")
    if read_back is None:
        from forge_lm.testing._references import METRICS_READERS

        read_back = METRICS_READERS.get(subject.component.name)
        if read_back is None or subject.component.plugin.distribution != CORE_DISTRIBUTION:
            raise AssertionError(
                f"{subject.label}: give the kit a reader of what the backend recorded: "
                "component_checks('metrics_backends', name, read_back=my_reader)"
            )
    with tempfile.TemporaryDirectory() as work:
        output = _run(subject, Path(work))
        recorded = list(read_back(Path(work), output))
    assert [step for step, _ in recorded] == [step for step, _ in LOGGED], (
        f"{subject.label} recorded steps {[s for s, _ in recorded]}; the kit logged steps "
        f"{[s for s, _ in LOGGED]} and expects the same list read back"
    )
    for (step, sent), (_, got) in zip(LOGGED, recorded, strict=True):
        for key, value in sent.items():
            assert key in got, (
                f"{subject.label} lost '{key}' at step {step}: it logged {sorted(sent)}, read back {sorted(got)}; "
                "the kit expects every logged key"
            )
            same = math.isnan(value) and math.isnan(got[key]) if math.isnan(value) else math.isclose(got[key], value)
            assert same, (
                f"{subject.label} recorded {key}={got[key]} at step {step}; the kit logged {value} and expects it "
                "back (NaN as NaN; else equal within math.isclose's relative tolerance 1e-9)"
            )
