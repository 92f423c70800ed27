"""Hostile and broken run directories: locked by a live run or a dead one, read-only, in the
way of a file, with a corrupt config.toml or plugins.json, with links among its files; and
starts that fail or are signalled before their first step, which must leave nothing behind.

Read-only cases are honest under root, which ignores permission bits: while such a case
runs, this process leaves out CAP_DAC_OVERRIDE (and CAP_DAC_READ_SEARCH) from its effective
capabilities, so the kernel checks the bits as for any owner, and takes them back afterwards.
Run as another user, chmod alone does it and the capabilities are not there to drop.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from _hostile import TINY, TRAINED_STEPS, Case, Outcome, Workspace, case_params

from forge_lm.cli._main import main
from forge_lm.metrics.jsonl import read_metrics

RESUME = ("train", "{tiny}", "--train.max_steps=6", "--train.output_dir={run}")
FRESH = ("train", "{tiny}", "--train.max_steps=2", "--train.output_dir={run}")
LOCK = ".lock"
NOT_A_RUN = "{root}/elsewhere"

# -- processes a case starts: stopped after every test, whatever happened ----------------------

_started: list[tuple[Path, subprocess.Popen[str]]] = []  # (the case's workspace root, the process)
_read_only: list[Path] = []

HOLDER = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": "2031-05-04T03:02:01+00:00",
          "pid_namespace": os.stat("/proc/self/ns/pid").st_ino, **json.loads(sys.argv[2])}
os.ftruncate(fd, 0)
os.write(fd, json.dumps(holder).encode())
print("locked", flush=True)
time.sleep(600)
"""


def _hold_lock(ws: Workspace, **fields: object) -> subprocess.Popen[str]:
    """Another process that takes the run directory's lock (as ``forge train`` does) and keeps it."""
    ws.run.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(ws.run / LOCK), json.dumps(fields)], stdout=subprocess.PIPE, text=True
    )
    _started.append((ws.root, proc))
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _holder(ws: Workspace) -> subprocess.Popen[str]:
    return next(proc for root, proc in _started if root == ws.root)


@pytest.fixture(autouse=True)
def _clean_up() -> Iterator[None]:
    yield
    _dac_override(True)
    for root in _read_only:
        for path in [root, *root.rglob("*")]:
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | stat.S_IWUSR)
    _read_only.clear()
    for _, proc in _started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout:
            proc.stdout.close()
    _started.clear()


# -- read-only, honestly, also for root --------------------------------------------------------


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_DAC = (1 << 1) | (1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH


def _dac_override(enabled: bool) -> None:
    """Put the permission-bypassing capabilities in or out of this process's effective set
    (only those it is permitted: none for an ordinary user, for whom this is a no-op)."""
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3
    assert libc.capget(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())
    wanted = data[0].effective | (data[0].permitted & _DAC) if enabled else data[0].effective & ~_DAC
    if wanted != data[0].effective:
        data[0].effective = wanted
        assert libc.capset(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())


def _read_only_at(*relative: str, recursive: bool = False) -> Callable[[Workspace], None]:
    """Take write permission from these paths of the workspace (all below them if recursive)."""

    def setup(ws: Workspace) -> None:
        for name in relative:
            top = ws.root / name.format(run=ws.run.name)
            if not top.exists():
                top.mkdir(parents=True)
            paths = [*top.rglob("*"), top] if recursive else [top]
            for path in paths:
                path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        _read_only.append(ws.root)
        _dac_override(False)  # from here to the check, root obeys the bits too

    return setup


def _snapshot(ws: Workspace) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(ws.root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(ws.root.rglob("*"))
        if not p.is_symlink()
    }


def _unchanged(setup: Callable[[Workspace], None] | None = None) -> tuple[Callable, Callable]:
    """A setup that records the whole workspace and a check that nothing in it changed."""
    before: dict[str, dict] = {}

    def record(ws: Workspace) -> None:
        if setup is not None:
            setup(ws)
        before[str(ws.root)] = _snapshot(ws)  # reading needs no capability: the files are ours

    def check(ws: Workspace, outcome: Outcome) -> None:
        _dac_override(True)
        assert _snapshot(ws) == before.pop(str(ws.root))

    return record, check


# -- setups --------------------------------------------------------------------------------------


def _held_by_live_run(ws: Workspace) -> None:
    _hold_lock(ws)


def _held_by_killed_run(ws: Workspace) -> None:
    proc = _hold_lock(ws)
    proc.kill()  # SIGKILL: the kernel drops the flock, the file stays
    proc.wait()


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)


def _held_by_orphan_of_dead_run(ws: Workspace) -> None:
    _hold_lock(ws, pid=_dead_pid())  # the flock is held, by a process the file does not name


def _lock_file(content: bytes) -> Callable[[Workspace], None]:
    return lambda ws: (ws.run / LOCK).write_bytes(content)


def _file_at(relative: str, content: bytes = b"not a directory\n") -> Callable[[Workspace], None]:
    def setup(ws: Workspace) -> None:
        path = ws.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)

    return setup


OUTSIDE = "outside/victim.txt"  # a user's file outside the run, which a link in the run points to


def _linked_out(relative: str, *, dangling: bool = False) -> Callable[[Workspace], None]:
    """``run/<relative>`` (replaced if there) becomes a link to a file outside the run (or to a
    place where nothing is yet, if ``dangling``)."""

    def setup(ws: Workspace) -> None:
        outside = ws.root / OUTSIDE
        outside.parent.mkdir(exist_ok=True)
        if not dangling:
            outside.write_bytes(b"precious: not Forge's to write\n")
        link = ws.run / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(outside)

    return setup


def _checkpoints_linked_to_a_copy(ws: Workspace) -> None:
    """``run/checkpoints`` is a link to another run's checkpoints (here a copy of this run's)."""
    other = ws.root / "other-run-checkpoints"
    shutil.copytree(ws.checkpoints, other, symlinks=True)
    shutil.rmtree(ws.checkpoints)
    ws.checkpoints.symlink_to(other, target_is_directory=True)


def _deeply_nested_metrics_line(ws: Workspace) -> None:
    with (ws.run / "metrics.jsonl").open("a") as metrics:
        metrics.write("[" * 100_000 + "]" * 100_000 + "\n")


def _nothing_at_the_links_target(ws: Workspace, outcome: Outcome) -> None:
    assert not os.path.lexists(ws.root / OUTSIDE), "a file was created through the link"


def _eval_link_left_alone(ws: Workspace, outcome: Outcome) -> None:
    _nothing_at_the_links_target(ws, outcome)
    assert (ws.run / "eval" / "step_4.json").is_symlink()


def _config_toml(content: bytes | None) -> Callable[[Workspace], None]:
    def setup(ws: Workspace) -> None:
        config = ws.run / "config.toml"
        config.unlink()
        if content is None:
            config.mkdir()
        else:
            config.write_bytes(content)

    return setup


def _no_checkpoint_and_another_model(ws: Workspace) -> None:
    """A run directory whose start stopped before its first checkpoint, made with model.dim = 48."""
    shutil.rmtree(ws.checkpoints)
    (ws.run / "metrics.jsonl").unlink()
    config = ws.run / "config.toml"
    config.write_text(re.sub(r"(?m)^dim = 32$", "dim = 48", config.read_text()))
    assert "dim = 48" in config.read_text()


def _out_of_vocab_data(ws: Workspace) -> None:
    ids = np.arange(4096, dtype=np.uint16) % 300  # the byte tokenizer's vocabulary is 257
    np.save(ws.root / "tokens.npy", ids)


OUT_OF_VOCAB = ("--data.name=memmap", "--data.path={root}/tokens.npy")
OUT_OF_VOCAB_LINE = (
    r"forge: error: the memmap data at '.*tokens\.npy' holds token id \d+, outside the model's vocabulary of 257"
)

SIGNALS = """
import os, signal, time
from forge_lm import hookimpl
from forge_lm.data.synthetic import SyntheticTokens

FORGE_LM_PLUGIN_API = ">=1,<2"


def _fire(where):
    wanted = os.environ.get("FAULT_SIGNAL_IN", "")
    if wanted.startswith(where + ":"):
        os.kill(os.getpid(), getattr(signal, wanted.split(":")[1]))


@hookimpl
def forge_lm_configure(config):
    _fire("configure")


@hookimpl
def forge_lm_register_datasets(register):
    def build(options, context):
        _fire("build")
        return SyntheticTokens(context)

    register("signalled", build, description="synthetic tokens; may signal while being built")


@hookimpl
def forge_lm_train_start(context):
    _fire("train_start")


@hookimpl
def forge_lm_step_end(step):
    if str(step) == os.environ.get("FAULT_SLEEP_AT_STEP"):
        time.sleep(600)
"""


def _faults_site(ws: Workspace) -> Path:
    site = ws.root / "site"
    (site / "forge_startup_faults-1.0.dist-info").mkdir(parents=True)
    (site / "forge_startup_faults.py").write_text(SIGNALS)
    info = site / "forge_startup_faults-1.0.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: forge-startup-faults\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[forge_lm]\nstartup_faults = forge_startup_faults\n")
    return site


def _signal_in(where: str) -> Callable[[Workspace], None]:
    def setup(ws: Workspace) -> None:
        ws.env["PYTHONPATH"] = os.pathsep.join([str(_faults_site(ws)), os.environ.get("PYTHONPATH", "")])
        ws.env["FAULT_SIGNAL_IN"] = where

    return setup


def _forge_train_running(ws: Workspace) -> None:
    """A real ``forge train`` in another process, sleeping in its first step: it holds the lock."""
    site = _faults_site(ws)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_LM_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]), FAULT_SLEEP_AT_STEP="1")
    argv = [*TINY, "--train.max_steps=50", f"--train.output_dir={ws.run}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "forge_lm", "train", *argv], cwd=ws.root, env=env, stdout=subprocess.DEVNULL, text=True
    )
    _started.append((ws.root, proc))
    deadline = time.monotonic() + 240  # a start-up on a loaded machine; not a timing assertion
    while not _lock_names(ws.run / LOCK, proc.pid):
        assert proc.poll() is None, f"the first forge train ended early with {proc.returncode}"
        assert time.monotonic() < deadline, "the first forge train never locked its run directory"
        time.sleep(0.1)


def _lock_names(path: Path, pid: int) -> bool:
    try:
        return json.loads(path.read_text()).get("pid") == pid
    except (OSError, ValueError):
        return False


# -- checks --------------------------------------------------------------------------------------


def _names_holder(ws: Workspace, outcome: Outcome) -> None:
    holder = _holder(ws)
    assert f"pid {holder.pid} on host {socket.gethostname()}, running since 2031-05-04T03:02:01" in outcome.stderr
    assert json.loads((ws.run / LOCK).read_text())["pid"] == holder.pid  # the holder's lock left alone
    assert holder.poll() is None


def _nothing_but_the_lock(ws: Workspace, outcome: Outcome) -> None:
    _names_holder(ws, outcome)
    assert sorted(p.name for p in ws.run.iterdir()) == [LOCK]  # nothing written beside it


def _resumed_and_released(ws: Workspace, outcome: Outcome) -> None:
    assert "resumed from" in outcome.stderr
    assert (ws.checkpoints / "latest").read_text().strip() == "step_6"
    assert not (ws.run / LOCK).exists()  # released and removed at the end


def _took_over_the_killed_holder(ws: Workspace, outcome: Outcome) -> None:
    assert f"taking over the stale lock of pid {_holder(ws).pid} on host {socket.gethostname()}" in outcome.stderr
    _resumed_and_released(ws, outcome)


def _nothing_left(*relative: str) -> Callable[[Workspace, Outcome], None]:
    def check(ws: Workspace, outcome: Outcome) -> None:
        for name in relative or ("run",):
            assert not (ws.root / name).exists(), f"{name} was left behind"

    return check


def _second_run_refused_then_same_command_works(ws: Workspace, outcome: Outcome) -> None:
    first = _holder(ws)
    assert f"is in use by another run: pid {first.pid} on host {socket.gethostname()}" in outcome.stderr
    first.kill()  # the first run dies at step 1, before any checkpoint: its lock file stays
    first.wait()
    assert _lock_names(ws.run / LOCK, first.pid)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["train", *TINY, "--train.max_steps=2", f"--train.output_dir={ws.run}"]) == 0
    assert f"forge: warning: taking over the stale lock of pid {first.pid}" in err.getvalue()
    assert "holds no checkpoint yet, so this run starts it afresh" in err.getvalue()  # the first had max_steps=50
    assert (ws.checkpoints / "latest").read_text().strip() == "step_2"


def _corrected_config_starts_it(ws: Workspace, outcome: Outcome) -> None:
    kept = ["config.toml", "events.jsonl", "metrics.jsonl", "plugins.json", "run_id"]
    assert sorted(p.name for p in ws.run.iterdir()) == kept
    err = io.StringIO()
    argv = [
        "train",
        *TINY,
        "--train.max_steps=2",
        f"--train.output_dir={ws.run}",
        *OUT_OF_VOCAB,
        "--model.vocab_size=512",
    ]
    with contextlib.redirect_stderr(err):
        assert main([arg.format(root=ws.root) for arg in argv]) == 0
    assert "holds no checkpoint yet, so this run starts it afresh" in err.getvalue()
    assert "model.vocab_size" in err.getvalue()


def _config_replaced(ws: Workspace, outcome: Outcome) -> None:
    assert "dim = 32" in (ws.run / "config.toml").read_text()
    assert (ws.checkpoints / "latest").read_text().strip() == "step_6"


def _manifest_replaced(ws: Workspace, outcome: Outcome) -> None:
    assert isinstance(json.loads((ws.run / "plugins.json").read_text()), list)
    assert (ws.checkpoints / "latest").read_text().strip() == "step_6"


def _resume_untouched(ws: Workspace, outcome: Outcome) -> None:
    assert not list(ws.run.glob("config.resume-*.toml"))
    assert not (ws.run / LOCK).exists()
    steps = [r["step"] for r in read_metrics(ws.run / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, TRAINED_STEPS + 1))


def _both(*checks: Callable[[Workspace, Outcome], None]) -> Callable[[Workspace, Outcome], None]:
    def check(ws: Workspace, outcome: Outcome) -> None:
        for one in checks:
            one(ws, outcome)

    return check


_ro_run = _unchanged(_read_only_at("{run}", recursive=True))
_ro_checkpoints = _unchanged(_read_only_at("{run}/checkpoints"))
_ro_metrics = _unchanged(_read_only_at("{run}/metrics.jsonl"))
_ro_parent = _unchanged(_read_only_at("parent"))
_corrupt_toml = _unchanged(_config_toml(b'[model]\ndim = "unterminated\n'))
_latin1_toml = _unchanged(_config_toml('[train]\noutput_dir = "caf\u00e9"\n'.encode("latin-1")))
_dir_toml = _unchanged(_config_toml(None))
_no_config = _unchanged(lambda ws: (ws.run / "config.toml").unlink())
_file_run = _unchanged(_file_at("run"))
_file_parent = _unchanged(_file_at("afile"))
_lock_dir = _unchanged(lambda ws: (ws.run / LOCK).mkdir())
_checkpoints_file = _unchanged(_file_at("run/checkpoints"))
_lock_link = _unchanged(_linked_out(LOCK))
_dangling_lock_link = _unchanged(_linked_out(LOCK, dangling=True))
_metrics_link = _unchanged(_linked_out("metrics.jsonl"))
_events_link = _unchanged(_linked_out("events.jsonl"))
_checkpoints_link = _unchanged(_checkpoints_linked_to_a_copy)
_deep_metrics = _unchanged(_deeply_nested_metrics_line)

HELD = r"forge: error: \[train\] output_dir: '.*/run' is in use by another run: pid \d+ on host "
LINKED = r"forge: error: '.*/run/{}' is a symbolic link \(to '.*/{}'\); Forge does not follow links inside a run "
LINKED += "directory"
CANNOT_RESUME = r"forge: error: cannot resume the run in '.*/run': "

CASES = [
    # -- the lock: one run per directory ------------------------------------------------------------
    Case("locked-by-a-live-run", RESUME, 2, HELD, _held_by_live_run, needs_run=True, check=_names_holder),
    Case("locked-empty-dir-nothing-written", FRESH, 2, HELD, _held_by_live_run, check=_nothing_but_the_lock),
    Case(
        "second-forge-train-on-one-dir",
        FRESH,
        2,
        HELD,
        _forge_train_running,
        check=_second_run_refused_then_same_command_works,
    ),
    Case(
        "stale-lock-of-a-killed-run",
        RESUME,
        0,
        r"forge: warning: taking over the stale lock of pid \d+ on host .* since 2031-05-04T03:02:01\+00:00 in "
        r"'.*/run': that run has ended\.$",
        _held_by_killed_run,
        needs_run=True,
        check=_took_over_the_killed_holder,
    ),
    Case(
        "stale-lock-still-flocked-by-an-orphan",
        RESUME,
        0,
        r"forge: warning: taking over the stale lock of pid \d+ on host ",
        _held_by_orphan_of_dead_run,
        needs_run=True,
        check=_resumed_and_released,
    ),
    Case(
        "stale-lock-from-another-host",
        RESUME,
        0,
        r"forge: warning: taking over the stale lock of pid 4242 on host node-17 since 2020-01-01 in '.*/run'",
        _lock_file(b'{"host": "node-17", "pid": 4242, "started": "2020-01-01"}'),
        needs_run=True,
        check=_resumed_and_released,
    ),
    Case(
        "stale-lock-unreadable",
        RESUME,
        0,
        r"forge: warning: taking over the stale lock of an unknown process \(unreadable lock file\)",
        _lock_file(b"\x00\xff garbage"),
        needs_run=True,
        check=_resumed_and_released,
    ),
    Case(
        "lock-file-is-a-directory",
        RESUME,
        2,
        r"forge: error: \[train\] output_dir: cannot lock '.*/run': '.*/run/\.lock' is a directory",
        _lock_dir[0],
        needs_run=True,
        check=_lock_dir[1],
    ),
    # -- read-only or blocked paths -------------------------------------------------------------------
    Case(
        "read-only-run-dir",
        RESUME,
        2,
        CANNOT_RESUME + r"the directory is not writable \(Permission denied: cannot create its lock file '\.lock'\)\. "
        r"Make the run directory writable again",
        _ro_run[0],
        needs_run=True,
        check=_ro_run[1],
    ),
    Case(
        "read-only-checkpoints-dir",
        RESUME,
        2,
        CANNOT_RESUME + r"'.*/run/checkpoints' cannot be written \(Permission denied\)\. Make the run directory",
        _ro_checkpoints[0],
        needs_run=True,
        check=_ro_checkpoints[1],
    ),
    Case(
        "read-only-metrics-file",
        RESUME,
        2,
        CANNOT_RESUME + r"'.*/run/metrics\.jsonl' cannot be written \(Permission denied\)",
        _ro_metrics[0],
        needs_run=True,
        check=_ro_metrics[1],
    ),
    Case(
        "new-run-under-a-read-only-dir",
        ("train", "{tiny}", "--train.output_dir={root}/parent/run"),
        2,
        r"forge: error: \[train\] output_dir: cannot create '.*/parent/run': Permission denied\. Choose a writable",
        _ro_parent[0],
        check=_ro_parent[1],
    ),
    Case(
        "output-dir-is-a-file",
        FRESH,
        2,
        r"forge: error: \[train\] output_dir: '.*/run' is a file, not a directory; choose another",
        _file_run[0],
        check=_file_run[1],
    ),
    Case(
        "output-dir-under-a-file",
        ("train", "{tiny}", "--train.output_dir={root}/afile/runs/run"),
        2,
        r"forge: error: \[train\] output_dir: '.*/afile/runs/run' cannot be created: '.*/afile' is a file, not a "
        r"directory",
        _file_parent[0],
        check=_file_parent[1],
    ),
    Case(
        "checkpoints-is-a-file",
        FRESH,
        2,
        r"forge: error: \[train\] output_dir: '.*/run/checkpoints' is not a directory, but the run's checkpoints",
        _checkpoints_file[0],
        check=_checkpoints_file[1],
    ),
    # -- what the run directory holds --------------------------------------------------------------------
    Case(
        "config-toml-corrupt",
        RESUME,
        2,
        CANNOT_RESUME + r"config file '.*/run/config\.toml' is not valid TOML: .*Restore it",
        _corrupt_toml[0],
        needs_run=True,
        check=_corrupt_toml[1],
    ),
    Case(
        "config-toml-not-utf8",
        RESUME,
        2,
        CANNOT_RESUME + r"config file '.*/run/config\.toml' is not valid TOML: it is not UTF-8 text",
        _latin1_toml[0],
        needs_run=True,
        check=_latin1_toml[1],
    ),
    Case(
        "config-toml-is-a-directory",
        RESUME,
        2,
        CANNOT_RESUME + r"config file '.*/run/config\.toml' cannot be read: Is a directory\. Restore it",
        _dir_toml[0],
        needs_run=True,
        check=_dir_toml[1],
    ),
    Case(
        "checkpoints-without-config-toml",
        RESUME,
        2,
        r"forge: error: \[train\] output_dir: '.*/run' holds checkpoints but no config\.toml",
        _no_config[0],
        needs_run=True,
        check=_no_config[1],
    ),
    Case(
        "plugins-json-corrupt",
        RESUME,
        0,
        r"forge: warning: resuming '.*/run': its plugins\.json is not valid JSON \(.*\), so whether the plugins "
        r"changed cannot be told; it is replaced by this run's plugins",
        _file_at("run/plugins.json", b"[{not json"),
        needs_run=True,
        check=_manifest_replaced,
    ),
    Case(
        "plugins-json-not-a-list-of-plugins",
        RESUME,
        0,
        r"forge: warning: resuming '.*/run': its plugins\.json is not a list of plugins",
        _file_at("run/plugins.json", b'{"name": "moe"}'),
        needs_run=True,
        check=_manifest_replaced,
    ),
    Case(
        "no-checkpoint-other-model-accepted",
        RESUME,
        0,
        r"forge: warning: '.*/run' holds no checkpoint yet, so this run starts it afresh and replaces its "
        r"config\.toml and plugins\.json \(changed settings: model\.dim(, train\.max_steps)?\)$",
        _no_checkpoint_and_another_model,
        needs_run=True,
        check=_config_replaced,
    ),
    # -- links inside the run directory: refused before anything is written, never followed ---------------
    Case(
        "lock-file-is-a-link-out-of-the-run",
        RESUME,
        2,
        LINKED.format(r"\.lock", OUTSIDE),
        _lock_link[0],
        needs_run=True,
        check=_lock_link[1],
    ),
    Case(
        "lock-file-is-a-dangling-link",
        FRESH,
        2,
        LINKED.format(r"\.lock", OUTSIDE),
        _dangling_lock_link[0],
        check=_both(_dangling_lock_link[1], _nothing_at_the_links_target),
    ),
    Case(
        "metrics-jsonl-is-a-link-out-of-the-run",
        RESUME,
        2,
        LINKED.format(r"metrics\.jsonl", OUTSIDE),
        _metrics_link[0],
        needs_run=True,
        check=_metrics_link[1],
    ),
    Case(
        "events-jsonl-is-a-link-out-of-the-run",
        RESUME,
        2,
        LINKED.format(r"events\.jsonl", OUTSIDE),
        _events_link[0],
        needs_run=True,
        check=_events_link[1],
    ),
    Case(
        "checkpoints-is-a-link-to-another-runs",
        (*RESUME, "--checkpoint.keep_last_n=1"),
        2,
        LINKED.format("checkpoints", "other-run-checkpoints")
        + r".* Replace the link by a copy of what it points to, or remove it, or choose another train\.output_dir\.$",
        _checkpoints_link[0],
        needs_run=True,
        check=_checkpoints_link[1],  # the other run's checkpoints neither resumed from nor pruned
    ),
    Case(
        "eval-output-is-a-dangling-link",
        ("eval", "{run}", "--tasks", "any-task"),
        2,
        LINKED.format(r"eval/step_4\.json", OUTSIDE) + r".* Remove the link, or write the results elsewhere with "
        r"--output PATH\.$",
        _linked_out("eval/step_4.json", dangling=True),
        needs_run=True,
        check=_eval_link_left_alone,
    ),
    Case(
        "metrics-line-nested-too-deeply",
        ("plot", "{run}"),
        2,
        r"forge: error: .*/run/metrics\.jsonl: line \d+ is nested too deeply to be read as JSON\. Remove or repair "
        r"that line to plot the rest\.$",
        _deep_metrics[0],
        needs_run=True,
        check=_deep_metrics[1],
    ),
    # -- starts that fail at the first batch: nothing written ---------------------------------------
    Case(
        "out-of-vocab-ids-new-dir",
        (*FRESH, *OUT_OF_VOCAB),
        2,
        OUT_OF_VOCAB_LINE,
        _out_of_vocab_data,
        check=_nothing_left(),
    ),
    Case(
        "out-of-vocab-ids-new-nested-dir",
        ("train", "{tiny}", "--train.output_dir={root}/runs/a/b", *OUT_OF_VOCAB),
        2,
        OUT_OF_VOCAB_LINE,
        _out_of_vocab_data,
        check=_nothing_left("runs"),
    ),
    Case(
        "out-of-vocab-ids-existing-dir-then-corrected",
        (*FRESH, *OUT_OF_VOCAB),
        2,
        OUT_OF_VOCAB_LINE,
        lambda ws: (_out_of_vocab_data(ws), ws.run.mkdir()),
        check=_corrected_config_starts_it,
    ),
    # -- preemption signals during start-up: exit 75, nothing written ----------------------------------
    Case(
        "sigterm-while-configuring",
        (*FRESH, "--data.name=signalled"),
        75,
        r"forge: SIGTERM received during start-up: stopped before the first step, with nothing to save; run the "
        r"same command to start again\.$",
        _signal_in("configure:SIGTERM"),
        subprocess=True,
        check=_nothing_left(),
    ),
    Case(
        "sigusr1-while-building-on-resume",
        (*RESUME, "--data.name=signalled"),
        75,
        r"forge: SIGUSR1 received during start-up: stopped before the first step",
        _signal_in("build:SIGUSR1"),
        needs_run=True,
        subprocess=True,
        check=lambda ws, outcome: _resume_untouched(ws, outcome),
    ),
    Case(
        "sigterm-after-the-run-dir-was-made",
        (*FRESH, "--data.name=signalled"),
        75,
        r"forge: SIGTERM received during start-up: stopped before the first step",
        _signal_in("train_start:SIGTERM"),
        subprocess=True,
        check=_nothing_left(),
    ),
]


@pytest.mark.parametrize("case", case_params(CASES))
def test_case(case, run_case):
    run_case(case)
