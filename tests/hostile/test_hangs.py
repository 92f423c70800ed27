"""Hangs outside the training steps, and threads a plugin leaves behind: a ``train_start`` hook
that never returns, a metrics backend blocking in ``start`` or ``finish``, a plugin thread
that is not a daemon, and one that raises. Each case runs ``forge train`` in a subprocess (a
hang ends the process with ``os._exit``) with a short ``resilience.hang_timeout``; the plugin
is ``forge-hostile`` 1.0 installed into a site on the subprocess's ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from _hostile import TINY, Case, Outcome, Workspace, case_params
from test_plugins import install, site_of

HANG_S = 3  # resilience.hang_timeout of these runs: far above a tiny step, even on a loaded machine
TRAIN = (
    "train",
    "{tiny}",
    "--train.max_steps=4",
    "--train.output_dir={run}",
    f"--resilience.hang_timeout={HANG_S}",
)
WITH_BACKEND = (*TRAIN, '--metrics.backends=["jsonl", "hostile"]')


def plugin_in_subprocess(body: str) -> Callable[[Workspace], None]:
    def setup(ws: Workspace) -> None:
        site_of(ws).mkdir()
        install(ws, body)
        ws.env["PYTHONPATH"] = str(site_of(ws))

    return setup


def backend_blocking_in(method: str) -> Callable[[Workspace], None]:
    return plugin_in_subprocess(
        f"""
        import time

        class Backend:
            def start(self, config, manifest):
                pass

            def log(self, step, metrics):
                pass

            def finish(self, summary):
                pass

            def {method}(self, *args):
                time.sleep(600)  # a tracker's server that never answers


        @hookimpl
        def forge_lm_register_metrics_backends(register):
            register("hostile", lambda options, context: Backend(), description="A backend that blocks")
        """
    )


def hung_in(frame: str, trained: bool) -> Callable[[Workspace, Outcome], None]:
    """The stacks name ``frame``; the hang is in the event log; a run that trained kept its last checkpoint."""

    def check(ws: Workspace, outcome: Outcome) -> None:
        stacks = (ws.run / "hang" / "rank0.txt").read_text()
        assert f"in {frame}" in stacks, stacks
        kinds = [json.loads(line)["type"] for line in (ws.run / "events.jsonl").read_text().splitlines()]
        assert "hang" in kinds, kinds
        latest = ws.checkpoints / "latest"
        assert (latest.read_text().strip() if latest.exists() else None) == ("step_4" if trained else None)

    return check


def completed(ws: Workspace, outcome: Outcome) -> None:
    assert (ws.checkpoints / "latest").read_text().strip() == "step_4"
    assert "trained 4 steps" in outcome.stdout, outcome.stdout


def completed_but_failed(ws: Workspace, outcome: Outcome) -> None:
    """The run trained to its end, then said that it did not end well."""
    completed(ws, outcome)
    assert "forge: error: the run ended, but 1 of its threads raised (above); exiting with 4." in outcome.stderr


HUNG = (
    rf"forge: error: {{}} did not finish in {HANG_S} s \(resilience\.hang_timeout\); "
    r"wrote the Python stacks of rank 0 to "
)

CASES = [
    Case(
        "train-start-never-returns",
        TRAIN,
        77,
        HUNG.format(r"the plugins' forge_lm_train_start hooks"),
        setup=plugin_in_subprocess(
            """
            import time

            @hookimpl
            def forge_lm_train_start(context):
                time.sleep(600)
            """
        ),
        subprocess=True,
        check=hung_in("forge_lm_train_start", trained=False),
    ),
    Case(
        "metrics-backend-blocks-in-start",
        WITH_BACKEND,
        77,
        HUNG.format(r"the metrics backends' start"),
        setup=backend_blocking_in("start"),
        subprocess=True,
        check=hung_in("start", trained=False),
    ),
    Case(
        "metrics-backend-blocks-in-finish",
        WITH_BACKEND,
        77,
        HUNG.format(r"the run's end \(train_end, the metrics backends' finish, the last checkpoint's write\)"),
        setup=backend_blocking_in("finish"),
        subprocess=True,
        check=hung_in("finish", trained=True),
    ),
    Case(
        "plugin-thread-not-a-daemon",
        TRAIN,
        0,
        rf"forge: warning: thread 'hostile-uploader' in forever \(.*forge_hostile\.py:\d+\) is not a daemon and "
        rf"still runs {HANG_S} s after the run ended; ending the process without it\.",
        setup=plugin_in_subprocess(
            """
            import threading, time

            def forever():
                while True:
                    time.sleep(0.1)

            @hookimpl
            def forge_lm_train_start(context):
                threading.Thread(target=forever, name="hostile-uploader").start()
            """
        ),
        subprocess=True,
        check=completed,
    ),
    Case(
        "plugin-thread-raises",
        TRAIN,
        4,
        r"forge: error: thread 'hostile-worker' raised ValueError: no server in work \(.*forge_hostile\.py:\d+\)$",
        setup=plugin_in_subprocess(
            """
            import threading

            def work():
                raise ValueError("no server")

            @hookimpl
            def forge_lm_train_start(context):
                thread = threading.Thread(target=work, name="hostile-worker", daemon=True)
                thread.start()
                thread.join()
            """
        ),
        subprocess=True,
        check=completed_but_failed,
    ),
]


@pytest.mark.parametrize("case", case_params(CASES))
def test_case(case, run_case):
    run_case(case)


STOPPER = """
import os, signal
from pathlib import Path

from forge_lm import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl
def forge_lm_step_end(context, step):
    if step == 2:  # just before the checkpoint of step 2 is written
        Path(os.environ["STOPPED_MARKER"]).write_text("stopped")
        os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_process_stopped_longer_than_the_hang_timeout_goes_on_after_sigcont(tmp_path) -> None:
    # Issue 37: SIGSTOP past resilience.hang_timeout, then SIGCONT: the watchdog counted the
    # stopped time as a hang and the run exited 77 without the checkpoint it was about to write.
    ws = Workspace(root=tmp_path, run=tmp_path / "run", sentinel=tmp_path / "SENTINEL")
    plugin_in_subprocess(STOPPER)(ws)
    marker = tmp_path / "stopped"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_LM_")}
    env.update(ws.env, STOPPED_MARKER=str(marker))
    hang_s = 6  # a first checkpoint follows the stop: more time than the other cases' steps need
    args = [
        "train",
        *TINY,
        "--train.max_steps=4",
        f"--train.output_dir={ws.run}",
        f"--resilience.hang_timeout={hang_s}",
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "forge_lm", *args],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the process stops itself right after writing the marker
        assert process.poll() is None, process.communicate()
        time.sleep(2 * hang_s)  # stopped, as by a debugger or a job scheduler
        process.send_signal(signal.SIGCONT)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, err
    assert "Traceback" not in err
    assert not (ws.run / "hang").exists()
    assert (ws.checkpoints / "latest").read_text().strip() == "step_4"
    assert (ws.checkpoints / "step_2").is_dir()
