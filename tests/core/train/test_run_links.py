"""Links inside a run directory are never followed: each writer of the run's files refuses or
fails on a link where its file or folder goes, and whatever the link points to is left as it was
(the run directory's own check, before anything is written, is in tests/hostile/test_run_dirs.py).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from forge_lm.config import ProfilingSection
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.events import EventLog
from forge_lm.metrics.jsonl import JsonlBackend, read_metrics
from forge_lm.metrics.plot import plot_run
from forge_lm.run_lock import LOCK_FILE, RunLock
from forge_lm.train import resume_rules
from forge_lm.train.profiling import StepProfiler, _write_atomically
from forge_lm.train.run_dir import RunDirectory
from forge_lm.train.watchdog import HangWatchdog
from forge_lm_eval.command import _results_path

PRECIOUS = b"a user's file: not Forge's to write\n"
NOT_FOLLOWED = "is a symbolic link .*; Forge does not follow links inside a run directory"
ELOOP = os.strerror(errno.ELOOP)  # what O_NOFOLLOW gives for a link: "Too many levels of symbolic links"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    return run


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    victim = tmp_path / "outside" / "victim.txt"
    victim.parent.mkdir()
    victim.write_bytes(PRECIOUS)
    return victim


def _link(path: Path, target: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target, target_is_directory=target.is_dir())
    return path


def test_the_lock_never_opens_a_link_at_its_lock_file(run, victim, tmp_path):
    _link(run / LOCK_FILE, victim)
    with pytest.raises(OSError, match=ELOOP):
        RunLock(run).acquire()
    assert victim.read_bytes() == PRECIOUS

    (run / LOCK_FILE).unlink()
    _link(run / LOCK_FILE, tmp_path / "outside" / "new.txt")  # dangling: O_CREAT would create the target
    with pytest.raises(OSError, match=ELOOP):
        RunLock(run).acquire()
    assert not (tmp_path / "outside" / "new.txt").exists()


def test_the_event_log_does_not_append_through_a_link(run, victim, capsys):
    log = EventLog(_link(run / "events.jsonl", victim), rank=0)
    log.record("start")
    log.record("end")
    assert victim.read_bytes() == PRECIOUS
    assert capsys.readouterr().err.count("forge: warning: cannot write the event log") == 1  # once, then left alone


def test_the_jsonl_backend_does_not_append_through_a_link(run, victim):
    backend = JsonlBackend(_link(run / "metrics.jsonl", victim))
    with pytest.raises(OSError, match=ELOOP):
        backend.start({}, [])
    assert victim.read_bytes() == PRECIOUS


def test_a_run_file_forge_rewrites_is_not_written_through_a_link(run, victim):
    with pytest.raises(ConfigError, match="cannot write to"):
        resume_rules.write_run_file(_link(run / "config.resume-1.toml", victim), "[train]\n")
    assert victim.read_bytes() == PRECIOUS


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("my-metrics.jsonl", ("--metrics.jsonl.filename=my-metrics.jsonl",)),
        ("config.resume-1.toml", ()),
    ],
)
def test_the_run_directory_refuses_a_link_at_any_file_the_run_uses(tiny_config, manager, victim, name, overrides):
    config = tiny_config(*overrides)
    run = Path(config.train.output_dir)
    _link(run / name, victim)
    with pytest.raises(ForgeError, match=f"'{run / name}' {NOT_FOLLOWED}"), RunDirectory(run) as opened:
        opened.open(config, manager)
    assert victim.read_bytes() == PRECIOUS
    assert sorted(p.name for p in run.iterdir()) == [name]  # nothing written, no lock file left


def test_a_run_directory_that_is_itself_a_link_is_used_but_not_a_link_inside_it(tiny_config, manager, tmp_path):
    (tmp_path / "scratch" / "run").mkdir(parents=True)
    runs = _link(tmp_path / "runs", tmp_path / "scratch")  # runs -> /scratch, as on clusters
    config = tiny_config(f"--train.output_dir={runs / 'run'}")
    other = tmp_path / "other-run" / "checkpoints"
    other.mkdir(parents=True)
    inside = _link(runs / "run" / "checkpoints", other)
    with pytest.raises(ForgeError, match=f"'{inside}' {NOT_FOLLOWED}"), RunDirectory(config.train.output_dir) as run:
        run.open(config, manager)
    inside.unlink()
    with RunDirectory(config.train.output_dir) as run:
        assert run.open(config, manager) == (runs / "run", False)
    assert (tmp_path / "scratch" / "run" / "config.toml").is_file()


def test_a_deeply_nested_metrics_line_is_a_value_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    path.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n" + deep + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 2 is nested too deeply to be read as JSON$"):
        read_metrics(path)

    path.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n" + deep)  # cut short by a crash: skipped
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}]


def test_the_hang_stacks_are_not_written_through_a_link(run, victim, tmp_path):
    watchdog = HangWatchdog(1.0, run, 0)
    _link(watchdog.stacks_path, victim)
    with pytest.raises(OSError, match=ELOOP):
        watchdog._write_stacks()
    assert victim.read_bytes() == PRECIOUS

    watchdog.stacks_path.unlink()
    (run / "hang").rmdir()
    _link(run / "hang", victim.parent)
    with pytest.raises(ForgeError, match=f"'{run / 'hang'}' {NOT_FOLLOWED}"):
        watchdog._write_stacks()
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim.txt"]


def test_a_profile_file_is_never_written_through_a_link(run, victim):
    path = run / "trace.json"
    _link(path.with_name(f".{path.name}.partial"), victim)  # the temporary name before it was random, planted
    _link(run / "other.json", victim)
    _write_atomically(path, lambda tmp: Path(tmp).write_text("{}"))
    _write_atomically(run / "other.json", lambda tmp: Path(tmp).write_text("{}"))  # the link is replaced
    assert victim.read_bytes() == PRECIOUS
    for written in (path, run / "other.json"):
        assert not written.is_symlink()
        assert written.read_text() == "{}"


def test_a_memory_snapshot_is_never_written_through_a_link(run, victim, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda filename: Path(filename).write_bytes(b"snap"))
    _link(run / "profiles", victim.parent)
    with StepProfiler(ProfilingSection(memory_snapshot_step=1), run, 0, torch.device("cuda")) as profiler:
        profiler.step(1)
    assert profiler.written == []
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim.txt"]
    assert "forge: warning: could not write the memory snapshot" in capsys.readouterr().err

    (run / "profiles").unlink()
    snapshot = _link(run / "profiles" / "rank0" / "memory_snapshot_step1.pickle", victim)
    with StepProfiler(ProfilingSection(memory_snapshot_step=1), run, 0, torch.device("cuda")) as profiler:
        profiler.step(1)
    assert profiler.written == [snapshot]
    assert not snapshot.is_symlink()
    assert snapshot.read_bytes() == b"snap"
    assert victim.read_bytes() == PRECIOUS


def test_eval_refuses_a_link_where_its_results_would_go(run, victim, tmp_path):
    _link(run / "eval" / "step_4.json", tmp_path / "outside" / "results.json")  # dangling
    with pytest.raises(ForgeError, match=f"'{run / 'eval' / 'step_4.json'}' {NOT_FOLLOWED}.* --output PATH"):
        _results_path(run, 4)

    os.unlink(run / "eval" / "step_4.json")
    (run / "eval").rmdir()
    _link(run / "eval", victim.parent)
    with pytest.raises(ForgeError, match=f"'{run / 'eval'}' {NOT_FOLLOWED}"):
        _results_path(run, 4)


def test_plot_refuses_a_link_where_its_image_would_go(run, victim):
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "lr": 0.1}) + "\n")
    _link(run / "metrics.png", victim)
    with pytest.raises(ForgeError, match=f"'{run / 'metrics.png'}' {NOT_FOLLOWED}.* --output PNG"):
        plot_run(run)
    assert victim.read_bytes() == PRECIOUS
