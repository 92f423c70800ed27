"""The hang watchdog on its own: beats keep a process alive, silence ends it with 77 and the
stacks of where it waited, and a stopped or disabled watchdog never fires.

A firing watchdog ends its process (``os._exit``), so each case that may fire runs a small
script in a fresh interpreter, with real timeouts of one or two seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from forge_lm.train.watchdog import HANG_EXIT_CODE, HangWatchdog

# Time allowed beyond the timeout for the thread to wake, write and exit on a loaded machine.
MARGIN_S = 10.0

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from forge_lm import events
    from forge_lm.train.watchdog import HangWatchdog

    run_dir, mode, timeout = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])


    def wait_for_a_peer_that_never_comes():
        time.sleep(120)


    if mode == "events":
        events.open_log(run_dir, 3)
    if mode == "beats":  # a step every fifth of the timeout, for three timeouts
        with HangWatchdog(timeout, run_dir, 3) as watchdog:
            deadline = time.monotonic() + 3 * timeout
            while time.monotonic() < deadline:
                time.sleep(timeout / 5)
                watchdog.beat()
        print("trained through", flush=True)
    elif mode == "exited":  # the run ends before the timeout; the process lives on past it
        with HangWatchdog(timeout, run_dir, 3):
            time.sleep(timeout / 4)
        time.sleep(2 * timeout)
        print("lived on", flush=True)
    else:  # "silent", "events": a step, then none
        with HangWatchdog(timeout, run_dir, 3) as watchdog:
            watchdog.beat()
            print(f"started {time.time()}", flush=True)
            wait_for_a_peer_that_never_comes()
        print("the watchdog did not fire", flush=True)
    """
)


def _run(tmp_path: Path, mode: str, timeout: float, run_dir: Path | None = None):
    """Run the script in ``mode`` with a run directory (``<tmp>/run``, created, by default);
    returns the finished process and the seconds from its "started" line to its end."""
    script = tmp_path / "watched.py"
    script.write_text(SCRIPT)
    if run_dir is None:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
    result = subprocess.run(
        [sys.executable, str(script), str(run_dir), mode, str(timeout)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    ended = time.time()
    started = [float(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("started ")]
    return result, (ended - started[0]) if started else float("nan")


def test_beats_keep_the_process_alive_past_the_timeout(tmp_path: Path) -> None:
    result, _ = _run(tmp_path, "beats", 2.0)

    assert result.returncode == 0, result.stderr
    assert "trained through" in result.stdout
    assert not (tmp_path / "run" / "hang").exists()


def test_no_beat_exits_77_with_the_stacks_of_where_the_process_waited(tmp_path: Path) -> None:
    result, elapsed = _run(tmp_path, "silent", 1.0)

    assert result.returncode == HANG_EXIT_CODE == 77, result.stderr
    assert "the watchdog did not fire" not in result.stdout
    assert 1.0 <= elapsed <= 1.0 + MARGIN_S
    stacks = tmp_path / "run" / "hang" / "rank3.txt"
    text = stacks.read_text()
    assert text.startswith("forge hang watchdog: rank 3, pid ")
    assert "no optimizer step completed in 1 s" in text
    assert "MainThread" in text  # the header names the threads faulthandler shows by id
    assert "in wait_for_a_peer_that_never_comes" in text  # the main thread's frame
    assert "in <module>" in text
    message = [line for line in result.stderr.splitlines() if line.startswith("forge: error:")]
    assert message == [
        f"forge: error: no optimizer step completed in 1 s (resilience.hang_timeout); wrote the Python stacks of "
        f"rank 3 to {stacks}; exiting with 77. Compare the stacks of every rank in {stacks.parent}: a rank stuck "
        "outside the collective that the others wait in is the cause. Run the same command to resume from the "
        "newest checkpoint; raise resilience.hang_timeout if a step, evaluation or checkpoint legitimately takes "
        "longer (0 turns the watchdog off)."
    ]


def test_the_hang_is_recorded_in_the_event_log(tmp_path: Path) -> None:
    result, _ = _run(tmp_path, "events", 1.0)

    assert result.returncode == 77, result.stderr
    lines = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert len(lines) == 1
    assert lines[0]["type"] == "hang"
    assert lines[0]["rank"] == 3
    assert lines[0]["stacks"] == str(tmp_path / "run" / "hang" / "rank3.txt")
    assert lines[0]["seconds"] == 1.0


def test_an_unwritable_run_directory_gets_the_stacks_on_stderr(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the run directory would be inside a file: mkdir fails (even as root)
    result, _ = _run(tmp_path, "silent", 1.0, run_dir=blocker / "run")

    assert result.returncode == 77
    assert f"({blocker / 'run' / 'hang' / 'rank3.txt'} could not be written: " in result.stderr
    assert "in wait_for_a_peer_that_never_comes" in result.stderr
    assert "wrote the Python stacks of rank 3 to stderr; exiting with 77." in result.stderr


def test_a_watchdog_never_fires_after_it_is_exited(tmp_path: Path) -> None:
    result, _ = _run(tmp_path, "exited", 1.0)

    assert result.returncode == 0, result.stderr
    assert "lived on" in result.stdout
    assert not (tmp_path / "run" / "hang").exists()


def _watchdog_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "forge-hang-watchdog"]


def test_timeout_zero_starts_no_thread(tmp_path: Path) -> None:
    # In this process: a watchdog that is off can never end it.
    before = threading.active_count()
    with HangWatchdog(0, tmp_path, 0) as watchdog:
        assert threading.active_count() == before
        assert _watchdog_threads() == []
        watchdog.beat()  # harmless when off
    assert threading.active_count() == before


def test_exiting_stops_the_thread_at_once(tmp_path: Path) -> None:
    # In this process too: the timeout is far off, and __exit__ must end the thread now.
    with HangWatchdog(3600, tmp_path, 0) as watchdog:
        assert len(_watchdog_threads()) == 1
        watchdog.beat()
    assert _watchdog_threads() == []
    assert not (tmp_path / "hang").exists()
