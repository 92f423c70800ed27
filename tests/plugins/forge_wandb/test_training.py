"""`forge train` with the wandb backend, against the real wandb library in offline mode.

One short training (module fixture) writes an offline W&B run; the tests read its ``.wandb``
file back (forge_wandb.offline parses wandb's own protobuf records) and compare it with what
the core logged to metrics.jsonl beside it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest

from forge_lm import hookimpl
from forge_lm.components import MetricsContext
from forge_lm.config import load_config, structure_options, to_data
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginHookFailed, PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.train import train
from forge_wandb import offline
from forge_wandb.backend import WandbBackendWarning

TINY = (
    *TINY_MODEL,
    "--train.batch_size=4",
    "--train.seq_len=16",
    "--train.max_steps=6",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl", "wandb"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=3",
    "--eval.steps=2",
    "--checkpoint.interval=3",
    "--data.name=synthetic",
)


NO_EVAL_NOR_CHECKPOINTS = ("--eval.interval=0", "--checkpoint.interval=0")  # for the failure tests: less work
WANDB_OPTIONS = (
    "--metrics.wandb.project=forge-tests",
    "--metrics.wandb.group=tiny",
    '--metrics.wandb.tags=["ci", "synthetic"]',
)


@attrs.frozen
class Trained:
    config: object
    run_dir: Path
    wandb_file: Path  # the offline run's transaction log
    logged: dict  # what the core logged to metrics.jsonl, by step
    saved_states: list  # what the core stored under "plugins" at each checkpoint


def tiny_config(manager, run_dir: Path, *overrides: str):
    return load_config(None, [*TINY, f"--train.output_dir={run_dir}", *overrides], manager.registry)


@contextlib.contextmanager
def recording_plugin_states(manager) -> Iterator[list]:
    """The plugin states the core stores in each checkpoint (whatever the checkpoint's file format)."""
    saved_states = []
    save_states = manager.save_states

    def recording(context):
        saved_states.append(save_states(context))
        return saved_states[-1]

    manager.save_states = recording
    try:
        yield saved_states
    finally:
        del manager.save_states


@pytest.fixture(scope="module")
def trained(wandb_manager, tmp_path_factory, flush_wandb) -> Trained:
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    config = tiny_config(wandb_manager, run_dir, *WANDB_OPTIONS)
    with recording_plugin_states(wandb_manager) as saved_states:
        result = train(config, wandb_manager)
    assert result.status == "completed"
    flush_wandb()
    (wandb_file,) = offline.run_files(run_dir)
    logged = by_step(read_metrics(run_dir / "metrics.jsonl"))
    return Trained(config, run_dir, wandb_file, logged, saved_states)


def by_step(records: list[dict]) -> dict[int, dict]:
    """metrics.jsonl's records merged per step (training and evaluation metrics share a step)."""
    merged: dict[int, dict] = {}
    for record in records:
        step = record.pop("step")
        merged.setdefault(step, {}).update(record)
    return merged


def wait_for_the_next_second(wandb_file: Path) -> None:
    """W&B names an offline run's folder by its start time, to the second, and its id: a
    session resuming the same run within the same second would write into the first one's."""
    started = wandb_file.parent.name.split("-")[2]  # offline-run-YYYYMMDD_HHMMSS-<id>
    while time.strftime("%Y%m%d_%H%M%S") <= started:
        time.sleep(0.05)


def build_backend(manager, run_dir: Path, **table):
    component = manager.registry.resolve("metrics_backends", "wandb")
    options = structure_options(manager.registry, component, table, "metrics.wandb")
    return component.build(options, MetricsContext(run_dir=run_dir, run_name=str(run_dir), total_steps=10))


def test_offline_run_history_holds_every_step_and_value_the_core_logged(trained):
    logged = trained.logged
    history = offline.history(trained.wandb_file)
    assert [step for step, _ in history] == [1, 2, 3, 4, 5, 6]
    for step, recorded in history:
        assert recorded.keys() == logged[step].keys()
        for key, value in logged[step].items():
            assert math.isclose(recorded[key], value, rel_tol=1e-12), (step, key)
    assert {"loss", "lr", "grad_norm", "tokens_per_sec", "mfu"} <= history[0][1].keys()
    assert {"eval/loss", "eval/perplexity"} <= dict(history)[3].keys()


def test_offline_run_holds_the_resolved_config_and_the_plugin_manifest(trained, wandb_manager):
    recorded = offline.config(trained.wandb_file)
    plugins = recorded.pop("plugins")
    assert recorded == to_data(trained.config)
    assert plugins == {
        p["name"]: {"distribution": p["distribution"], "version": p["version"]} for p in wandb_manager.manifest()
    }
    assert plugins["wandb"]["distribution"] == "forge-wandb"


def test_offline_run_summary_holds_the_final_loss_and_step_count(trained):
    summary = offline.summary(trained.wandb_file)
    assert summary["final_loss"] == pytest.approx(trained.logged[6]["loss"], rel=1e-12)
    assert summary["steps"] == 6
    assert offline.exit_code(trained.wandb_file) == 0  # finished as a success


def test_offline_run_takes_project_group_tags_and_the_run_directory_name(trained):
    run = offline.run_record(trained.wandb_file)
    assert (run.project, run.run_group, list(run.tags)) == ("forge-tests", "tiny", ["ci", "synthetic"])
    assert run.display_name == "run"  # the run directory's name
    assert trained.wandb_file.parent.parent == trained.run_dir / "wandb"


def test_every_checkpoint_stores_the_wandb_run_id_through_the_plugin_state_hook(trained):
    run_id = offline.run_id(trained.wandb_file)
    assert trained.wandb_file.name == f"run-{run_id}.wandb"
    assert trained.saved_states == [{"wandb": {"run_id": run_id}}] * 2  # checkpoints at steps 3 and 6


def test_resuming_the_run_directory_continues_the_same_wandb_run(trained, wandb_manager, flush_wandb):
    first_id = offline.run_id(trained.wandb_file)
    wait_for_the_next_second(trained.wandb_file)
    # forge train into the same directory resumes from the checkpoint of step 6; 3 more steps.
    config = tiny_config(wandb_manager, trained.run_dir, *WANDB_OPTIONS, "--train.max_steps=9")
    with recording_plugin_states(wandb_manager) as saved_states:
        result = train(config, wandb_manager)
    assert (result.status, result.steps) == ("completed", 9)
    flush_wandb()
    first, second = offline.run_files(trained.run_dir)  # one offline folder per session, oldest first
    assert first == trained.wandb_file
    assert offline.run_id(second) == first_id
    assert second.parent.name.endswith(f"-{first_id}")
    assert [step for step, _ in offline.history(second)] == [7, 8, 9]
    assert [step for step, _ in offline.read_history(trained.run_dir)] == list(range(1, 10))
    assert saved_states == [{"wandb": {"run_id": first_id}}]  # the checkpoint of step 9: still the same run


def test_a_checkpoint_state_loaded_into_a_new_context_makes_the_backend_resume_that_run(
    trained, wandb_manager, tmp_path, flush_wandb
):
    first_id = offline.run_id(trained.wandb_file)
    # The core's resume order: load the checkpoint, give every plugin its state back (a new
    # context), and only then start the metrics backends.
    context = SimpleNamespace(run_dir=tmp_path / "run", step=6)
    assert wandb_manager.load_states(context, trained.saved_states[-1]) == []
    backend = build_backend(wandb_manager, tmp_path / "run", mode="offline")
    backend.start({"note": "resumed " * 8000}, [])  # a config record larger than a 32 KiB block
    assert backend.run.id == first_id
    assert wandb_manager.save_states(context) == {"wandb": {"run_id": first_id}}
    backend.log(7, {"loss": 1.5, "lr": 1e-4})
    backend.finish({"final_loss": 1.5, "steps": 7})
    flush_wandb()
    (wandb_file,) = offline.run_files(tmp_path / "run")
    assert offline.run_id(wandb_file) == first_id
    assert offline.config(wandb_file)["note"] == "resumed " * 8000
    assert offline.history(wandb_file) == [(7, {"loss": 1.5, "lr": 1e-4})]


def test_a_fresh_run_directory_starts_a_new_wandb_run(trained, wandb_manager, tmp_path, flush_wandb):
    backend = build_backend(wandb_manager, tmp_path / "fresh", mode="offline")
    backend.start({}, [])
    assert wandb_manager.save_states(SimpleNamespace(run_dir=tmp_path / "fresh")) == {
        "wandb": {"run_id": backend.run.id}
    }
    backend.log(1, {"loss": 2.0})
    backend.finish({})
    flush_wandb()
    (wandb_file,) = offline.run_files(tmp_path / "fresh")
    assert offline.run_id(wandb_file) not in ("", offline.run_id(trained.wandb_file))
    assert offline.history(wandb_file) == [(1, {"loss": 2.0})]
    assert wandb_manager.save_states(SimpleNamespace(run_dir=tmp_path / "fresh")) == {}  # finished: forgotten


def test_wandb_init_failure_warns_with_the_cause_and_training_completes(wandb_manager, tmp_path, monkeypatch):
    import wandb

    def unreachable(**kwargs):
        raise wandb.errors.CommError("cannot reach https://api.wandb.ai")

    monkeypatch.setattr(wandb, "init", unreachable)
    config = tiny_config(wandb_manager, tmp_path / "run", *NO_EVAL_NOR_CHECKPOINTS, "--metrics.wandb.mode=online")
    with pytest.warns(WandbBackendWarning, match=r"could not start a run \(CommError: cannot reach https://api"):
        result = train(config, wandb_manager)
    assert (result.status, result.steps) == ("completed", 6)
    assert sorted(by_step(read_metrics(tmp_path / "run" / "metrics.jsonl"))) == [1, 2, 3, 4, 5, 6]  # jsonl went on
    assert offline.run_files(tmp_path / "run") == []


def test_wandb_log_failure_mid_run_warns_and_the_other_backends_go_on(
    wandb_manager, tmp_path, monkeypatch, flush_wandb
):
    from wandb.sdk.wandb_run import Run

    log = Run.log

    def failing_from_step_4(self, data, step=None, **kwargs):
        if step >= 4:
            raise ConnectionResetError("the W&B service went away")
        return log(self, data, step=step, **kwargs)

    monkeypatch.setattr(Run, "log", failing_from_step_4)
    config = tiny_config(wandb_manager, tmp_path / "run", *NO_EVAL_NOR_CHECKPOINTS, "--metrics.wandb.mode=offline")
    with pytest.warns(WandbBackendWarning, match=r"failed to log step 4 \(ConnectionResetError: the W&B service"):
        result = train(config, wandb_manager)
    assert (result.status, result.steps) == ("completed", 6)
    assert sorted(by_step(read_metrics(tmp_path / "run" / "metrics.jsonl"))) == [1, 2, 3, 4, 5, 6]
    flush_wandb()
    (wandb_file,) = offline.run_files(tmp_path / "run")
    assert [step for step, _ in offline.history(wandb_file)] == [1, 2, 3]  # what it logged before failing
    assert offline.exit_code(wandb_file) == 1  # closed at the end, marked failed


def test_a_training_that_fails_finishes_its_wandb_run_as_failed(tmp_path, flush_wandb):
    class Diverge:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl
        def forge_lm_step_end(self, step):
            if step == 2:
                raise FloatingPointError("the loss diverged")

    manager = PluginManager(PluginSettings(autoload=False, allow=("wandb",)))
    manager.add_plugin(Diverge(), "diverge")
    config = tiny_config(manager, tmp_path / "run", *NO_EVAL_NOR_CHECKPOINTS, "--metrics.wandb.mode=offline")
    with pytest.raises(PluginHookFailed, match="raised in forge_lm_step_end: FloatingPointError: the loss diverged"):
        train(config, manager)
    flush_wandb()
    (wandb_file,) = offline.run_files(tmp_path / "run")
    assert offline.exit_code(wandb_file) == 1  # W&B shows the run as failed
    assert [step for step, _ in offline.history(wandb_file)] == [1, 2]  # step 2 happened: logged, then stopped
    assert "final_loss" in offline.summary(wandb_file)  # the summary of a failed run is still written


def test_offline_reader_refuses_a_damaged_log_and_stops_where_a_log_is_cut_short(trained, tmp_path):
    data = trained.wandb_file.read_bytes()
    complete = [record.WhichOneof("record_type") for record in offline.records(trained.wandb_file)]
    assert (complete[0], complete[1], complete[-1]) == ("header", "run", "exit")
    cut = tmp_path / "cut.wandb"
    cut.write_bytes(data[: len(data) // 2])  # a run still writing, or killed
    assert 1 < len(list(offline.records(cut))) < len(complete)
    damaged = bytearray(data)
    damaged[7 + 7 + 1] ^= 0xFF  # inside the first record's data: after the file and chunk headers
    (tmp_path / "damaged.wandb").write_bytes(damaged)
    with pytest.raises(ValueError, match="checksum mismatch"):
        list(offline.records(tmp_path / "damaged.wandb"))
    (tmp_path / "other.wandb").write_bytes(b"PK\x03\x04 not a W&B log")
    with pytest.raises(ValueError, match="not a W&B transaction log"):
        list(offline.records(tmp_path / "other.wandb"))
