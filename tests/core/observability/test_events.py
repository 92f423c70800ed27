"""The event log's own rules: one JSON object per line, plugin types, hostile values, ranks.

The events a real run records (start, checkpoints, preemption, resume, NaN steps, errors,
the end) are checked on the fault tests' runs in tests/core/train/test_faults.py, which
already train, signal and resume; the hang on the watchdog's 2-rank run.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from forge_lm import events
from forge_lm.errors import ConfigError
from forge_lm.plain_data import DEEPER, MAX_DEPTH
from forge_lm.plugins._calls import PLUGIN_HOOK_EXIT_CODE
from forge_lm.train.resilience import NonFiniteLoss, Preempted
from forge_lm.train.saving import SAVE_FAILED_EXIT_CODE, CheckpointSaveFailed

README = Path(__file__).parents[3] / "README.md"


@pytest.fixture
def log(tmp_path):
    yield events.open_log(tmp_path, rank=0)
    events.close_log()


def lines(log: events.EventLog) -> list[dict]:
    return [json.loads(line) for line in log.path.read_text().splitlines()]


def test_each_event_is_one_line_with_time_rank_step_and_type(log):
    events.set_step(7)
    events.record("evaluation", metrics={"eval/loss": 2.5})
    events.record("forge-moe/expert_load", counts=[3, 1])
    first, second = lines(log)
    assert set(first) == {"time", "rank", "step", "type", "metrics"}
    assert (first["rank"], first["step"], first["type"], first["metrics"]) == (0, 7, "evaluation", {"eval/loss": 2.5})
    assert (second["type"], second["counts"]) == ("forge-moe/expert_load", [3, 1])
    assert first["time"] <= second["time"]


@pytest.mark.parametrize("kind", ["", "custom", "a/b/c", "moe expert", "/x", 3])
def test_a_type_that_is_neither_forges_nor_namespaced_is_refused(log, kind):
    with pytest.raises(ValueError, match="'<plugin>/<what>'"):
        events.record(kind)
    assert not log.path.exists()


def test_values_json_cannot_hold_are_written_as_text_not_raised(log):
    class Opaque:
        def __repr__(self) -> str:
            return "<opaque>"

    events.record(
        "x/y", nan=math.nan, inf=-math.inf, tensor=torch.tensor(1.5), obj=Opaque(), path=Path("/a"), nested={1: (2,)}
    )
    (line,) = lines(log)
    assert line | {"time": 0} == {
        "time": 0, "rank": 0, "step": 0, "type": "x/y", "nan": "nan", "inf": "-inf", "tensor": 1.5,
        "obj": "<opaque>", "path": "/a", "nested": {"1": [2]},
    }  # fmt: skip


def test_a_value_holding_itself_is_cut_at_the_depth_limit_not_a_recursion_error(log):
    looped: list = []
    looped.append(looped)
    events.record("x/y", loop=looped)
    (line,) = lines(log)
    inner = line["loop"]
    for _ in range(MAX_DEPTH):  # the field's value is the top: MAX_DEPTH lists, then the marker
        (inner,) = inner
    assert inner == DEEPER


def test_fields_cannot_overwrite_the_common_keys(log):
    events.record("x/y", step=99, rank=5, note="kept")
    (line,) = lines(log)
    assert (line["step"], line["rank"], line["note"]) == (0, 0, "kept")


def test_other_ranks_record_only_their_own_hang_and_error_and_plugin_events(tmp_path):
    log = events.open_log(tmp_path, rank=1)
    try:
        for kind in events.EVENT_TYPES:
            events.record(kind)
        events.record("plugin/thing")
    finally:
        events.close_log()
    assert [(line["type"], line["rank"]) for line in lines(log)] == [("hang", 1), ("error", 1), ("plugin/thing", 1)]


def test_outside_a_run_recording_does_nothing(tmp_path):
    assert events.current() is None
    events.record("start")
    assert not list(tmp_path.iterdir())


def test_a_log_that_cannot_be_written_warns_once_and_the_run_goes_on(tmp_path, capsys):
    log = events.open_log(tmp_path / "missing" / "dir", rank=0)
    try:
        events.record("start")
        events.record("end")
    finally:
        events.close_log()
    assert capsys.readouterr().err.count("cannot write the event log") == 1
    assert not log.path.exists()


def test_lines_from_many_writers_never_interleave(tmp_path):
    """Each line is one append-mode write: two processes writing at once leave whole lines."""
    log = events.EventLog(tmp_path / "events.jsonl", rank=0)
    payload = "z" * 3000
    pid = os.fork()
    if pid == 0:  # the child writes as rank 1 would
        child = events.EventLog(log.path, rank=1)
        for _ in range(200):
            child.record("hang", payload=payload)
        os._exit(0)
    for _ in range(200):
        log.record("error", payload=payload)
    os.waitpid(pid, 0)
    records = lines(log)
    assert sorted(r["rank"] for r in records) == [0] * 200 + [1] * 200
    assert all(r["payload"] == payload for r in records)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (None, 0),
        (ConfigError("bad"), 2),
        (NonFiniteLoss("nan"), 3),
        (CheckpointSaveFailed("disk"), SAVE_FAILED_EXIT_CODE),
        (Preempted("SIGTERM", 3), 75),
        (KeyboardInterrupt(), 130),
        (RuntimeError("bug"), 1),
    ],
)
def test_exit_codes_of_errors_are_the_ones_the_cli_returns(error, code):
    assert events.exit_code_of(error) == code


def test_a_plugin_hook_failure_exits_4():
    from forge_lm.plugins._calls import PluginHookFailed

    assert PluginHookFailed.exit_code == PLUGIN_HOOK_EXIT_CODE == 4


def test_the_readme_lists_every_event_type():
    section = re.search(r"^### Event log\n(.*?)(?=^##)", README.read_text(), flags=re.DOTALL | re.MULTILINE).group(1)
    listed = re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE)
    assert listed == list(events.EVENT_TYPES)
