"""The run directory's lock: one run at a time, a dead holder's lock taken over, released at the end.

The "held by another process" cases use a real second process. It imports ``forge_lm.run_lock``
alone, which needs neither torch nor the training package (a fraction of a second per process).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import forge_lm.run_lock as run_lock
from forge_lm.errors import ForgeError
from forge_lm.run_lock import LOCK_FILE, RunDirLocked, RunLock

HOLDER = """
import sys
from forge_lm.run_lock import RunLock
lock = RunLock(sys.argv[1])
lock.acquire()
print("locked", flush=True)
if sys.stdin.read() == "release":  # hold until told; a closed stdin without the word: exit holding it
    lock.release()
"""


@pytest.fixture
def holders():
    """Start processes holding a run directory's lock; every one is stopped after the test."""
    started: list[subprocess.Popen[str]] = []

    def start(run_dir: Path) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(run_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        assert proc.stdout.readline().strip() == "locked"
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_lock_held_by_another_process_refuses_a_second_run_naming_the_holder(tmp_path, holders):
    holder = holders(tmp_path)
    with pytest.raises(RunDirLocked) as caught:
        RunLock(tmp_path).acquire()
    message = str(caught.value)
    assert message.startswith(
        f"[train] output_dir: '{tmp_path}' is in use by another run: pid {holder.pid} on host "
        f"{socket.gethostname()}, running since "
    )
    assert f"(lock file '{tmp_path / LOCK_FILE}')" in message
    assert "wait for that run to end or stop it, or choose another train.output_dir" in message
    assert isinstance(caught.value, ForgeError)  # the CLI's exit 2, one message
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid  # the holder's file is left alone


def test_a_released_lock_is_removed_and_free_for_the_next_run(tmp_path, holders, capsys):
    holder = holders(tmp_path)
    holder.communicate("release")
    assert holder.returncode == 0
    assert not (tmp_path / LOCK_FILE).exists()
    with RunLock(tmp_path) as lock:
        assert lock.held
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert capsys.readouterr().err == ""  # nothing stale about it


def test_the_lock_of_a_killed_holder_is_stale_and_taken_over_with_a_warning(tmp_path, holders, capsys):
    holder = holders(tmp_path)
    holder.kill()  # SIGKILL: no clean-up ran; the kernel dropped the flock
    holder.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid
    with RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert err.startswith(
        f"forge: warning: taking over the stale lock of pid {holder.pid} on host {socket.gethostname()} since "
    )
    assert f"in '{tmp_path}': that run has ended." in err


def test_a_lock_still_held_by_an_orphan_of_a_dead_holder_is_taken_over(tmp_path, holders, capsys):
    # The flock is held, but by a process other than the one the file names, which is gone: as
    # when a forked child inherited the descriptor and outlived the run.
    orphan = holders(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    (tmp_path / LOCK_FILE).write_text(json.dumps({**holder, "pid": dead_pid}))  # same file: still flocked
    with RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        with pytest.raises(RunDirLocked):  # a third run meets this one, not the orphan
            RunLock(tmp_path).acquire()
    assert orphan.poll() is None
    assert f"forge: warning: taking over the stale lock of pid {dead_pid} on host" in capsys.readouterr().err


def test_a_live_holder_on_this_host_keeps_the_lock_even_if_the_file_names_a_dead_pid_elsewhere(tmp_path, holders):
    holders(tmp_path)
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    (tmp_path / LOCK_FILE).write_text(json.dumps({**holder, "host": "another-node"}))
    with pytest.raises(RunDirLocked, match=r"is in use by another run: pid .* on host another-node"):
        RunLock(tmp_path).acquire()


def test_one_process_cannot_hold_one_directory_twice_and_release_frees_it(tmp_path):
    first = RunLock(tmp_path)
    first.acquire()
    with pytest.raises(RunDirLocked, match=f"pid {os.getpid()} on host"):
        RunLock(tmp_path).acquire()
    first.release()
    first.release()  # idempotent
    assert not (tmp_path / LOCK_FILE).exists()
    with RunLock(tmp_path):
        pass


def test_an_unreadable_lock_file_with_no_holder_is_taken_over(tmp_path, capsys):
    (tmp_path / LOCK_FILE).write_bytes(b"\xff\xfe not json")
    with RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert capsys.readouterr().err.startswith(
        "forge: warning: taking over the stale lock of an unknown process (unreadable lock file) in "
    )


def test_a_lock_file_that_cannot_be_created_raises_os_error(tmp_path):
    (tmp_path / LOCK_FILE).mkdir()
    with pytest.raises(IsADirectoryError):
        RunLock(tmp_path).acquire()
    with pytest.raises(FileNotFoundError):
        RunLock(tmp_path / "missing").acquire()


def test_without_flock_the_file_content_decides(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_lock, "_flock", lambda fd: None)  # e.g. Lustre mounted without flock
    here = run_lock.this_process()
    path = tmp_path / LOCK_FILE
    path.write_text(json.dumps({**here, "pid": 1 if os.getpid() != 1 else 2}))  # alive (init), this host
    with pytest.raises(RunDirLocked):
        RunLock(tmp_path).acquire()
    path.write_text(json.dumps({**here, "host": "another-node"}))  # cannot be checked: assumed alive
    with pytest.raises(RunDirLocked, match="on host another-node"):
        RunLock(tmp_path).acquire()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path.write_text(json.dumps({**here, "pid": int(dead.stdout)}))
    with RunLock(tmp_path):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert f"taking over the stale lock of pid {int(dead.stdout)}" in capsys.readouterr().err
    assert not path.exists()


def test_a_signal_killed_holder_leaves_no_lock_held(tmp_path, holders):
    holder = holders(tmp_path)
    holder.send_signal(signal.SIGTERM)  # the default action: no Python clean-up either
    holder.wait()
    with RunLock(tmp_path) as lock:
        assert lock.held
