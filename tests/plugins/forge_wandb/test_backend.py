"""The wandb backend's contract: the core's conformance checks (real wandb, offline), its
options, rank 0 only, and failures that turn it off instead of stopping training.

Where a failure of W&B itself is needed, a stand-in for the ``wandb`` module is handed to the
backend (the factory imports the real one; the backend takes whichever it is given).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from forge_lm.components import MetricsContext
from forge_lm.config import load_config, structure_options
from forge_lm.errors import ConfigError
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import parametrize_with_checks
from forge_wandb import backend as wandb_backend
from forge_wandb import offline
from forge_wandb.backend import WandbBackend, WandbBackendWarning
from forge_wandb.options import WandbOptions

MANIFEST = [{"name": "wandb", "distribution": "forge-wandb", "version": "0.1.0"}]


def read_back(run_dir: Path, output: str):
    """What the offline run under ``run_dir`` recorded, once W&B has written all of it."""
    import wandb

    wandb.teardown()  # run.finish() returns before the service writes the last records
    return offline.read_history(run_dir)


@parametrize_with_checks(
    components=[("metrics_backends", "wandb", {"options": {"mode": "offline"}, "read_back": read_back})],
    manager=PluginManager(PluginSettings(autoload=False, allow=("wandb",))),
)
def test_wandb_backend_passes_the_metrics_backend_conformance_checks(check):
    check()


class FakeRun:
    def __init__(self, run_id: str = "fake0001", *, fail_log: bool = False, fail_finish: bool = False) -> None:
        self.id, self.disabled = run_id, False
        self.summary: dict = {}
        self.logged: list = []
        self.finished_with: list = []
        self.fail_log, self.fail_finish = fail_log, fail_finish

    def log(self, data, step):
        if self.fail_log:
            raise OSError("broken pipe to the W&B service")
        self.logged.append((step, data))

    def finish(self, exit_code=None):
        self.finished_with.append(exit_code)
        if self.fail_finish:
            raise TimeoutError("W&B did not finish uploading")


class FakeWandb:
    """Stands in for the wandb module: records what init() was given."""

    def __init__(self, run: FakeRun | None = None, error: Exception | None = None) -> None:
        self.run, self.error = run or FakeRun(), error
        self.init_arguments: list[dict] = []

    def init(self, **arguments):
        self.init_arguments.append(arguments)
        if self.error is not None:
            raise self.error
        return self.run


@pytest.fixture(scope="module")
def registry(wandb_manager):
    return wandb_manager.registry


def options(registry, **table) -> WandbOptions:
    component = registry.resolve("metrics_backends", "wandb")
    return structure_options(registry, component, table, "metrics.wandb")


def make(registry, run_dir: Path, fake: FakeWandb, *, rank: int = 0, **table) -> WandbBackend:
    context = MetricsContext(run_dir=run_dir, run_name=str(run_dir), total_steps=10)
    return WandbBackend(options(registry, **table), context, fake, rank)


def test_metrics_wandb_section_options_reach_wandb_init(registry, tmp_path):
    config = load_config(
        None,
        [
            '--metrics.backends=["wandb"]',
            "--metrics.wandb.project=lm",
            "--metrics.wandb.entity=team",
            "--metrics.wandb.run_name=baseline",
            "--metrics.wandb.group=sweep-1",
            '--metrics.wandb.tags=["a", "b"]',
            "--metrics.wandb.mode=offline",
            f"--metrics.wandb.dir={tmp_path / 'elsewhere'}",
        ],
        registry,
    )
    (chosen,) = config.metrics.backends
    fake = FakeWandb()
    backend = WandbBackend(chosen.options, MetricsContext(run_dir=tmp_path / "run"), fake)
    backend.start({"model": {"dim": 32}}, MANIFEST)
    (arguments,) = fake.init_arguments
    assert arguments == {
        "project": "lm",
        "entity": "team",
        "name": "baseline",
        "group": "sweep-1",
        "tags": ["a", "b"],
        "mode": "offline",
        "dir": str(tmp_path / "elsewhere"),
        "config": {"model": {"dim": 32}, "plugins": {"wandb": {"distribution": "forge-wandb", "version": "0.1.0"}}},
        "reinit": "create_new",
    }  # no id, no resume: a fresh run directory starts a new W&B run
    backend.finish({})


def test_unset_options_leave_project_and_mode_to_wandb_and_files_in_the_run_directory(registry, tmp_path):
    assert options(registry) == WandbOptions()
    assert (WandbOptions().project, WandbOptions().mode, WandbOptions().dir) == (None, None, None)
    fake = FakeWandb()
    backend = make(registry, tmp_path / "run-7", fake)
    backend.start({}, [])
    (arguments,) = fake.init_arguments
    assert (arguments["project"], arguments["mode"]) == (None, None)  # WANDB_PROJECT / WANDB_MODE decide
    assert (arguments["name"], arguments["dir"]) == ("run-7", str(tmp_path / "run-7"))
    backend.finish({})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--metrics.wandb.mode=online-ish", "[metrics.wandb] mode: must be one of 'online', 'offline', 'disabled'"),
        ("--metrics.wandb.project=", "[metrics.wandb] project: must not be empty"),
        ('--metrics.wandb.tags=["ok", ""]', "[metrics.wandb] tags: each tag must be 1 to 64 characters"),
        (
            "--metrics.wandb.projekt=lm",
            "[metrics.wandb] projekt: unknown key for metrics backend 'wandb'. Did you mean 'project'?",
        ),
    ],
)
def test_invalid_wandb_options_are_refused_naming_section_and_key(registry, override, message):
    with pytest.raises(ConfigError) as caught:
        load_config(None, ['--metrics.backends=["wandb"]', override], registry)
    assert message in str(caught.value)


def test_only_rank_0_logs_other_ranks_neither_import_nor_call_wandb(wandb_manager, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")

    def no_import():
        raise AssertionError("rank 1 imported wandb")

    monkeypatch.setattr(wandb_backend, "_import_wandb", no_import)
    component = wandb_manager.registry.resolve("metrics_backends", "wandb")
    backend = component.build(options(wandb_manager.registry), MetricsContext(run_dir=tmp_path / "run"))
    backend.start({}, MANIFEST)
    backend.log(1, {"loss": 1.0})
    backend.finish({"final_loss": 1.0})
    assert (backend.rank, backend.run) == (1, None)
    assert not (tmp_path / "run").exists()

    fake = FakeWandb()
    rank_0 = make(wandb_manager.registry, tmp_path / "run0", fake, rank=0)
    rank_0.start({}, MANIFEST)
    rank_0.log(1, {"loss": 1.0})
    assert fake.run.logged == [(1, {"loss": 1.0})]
    rank_0.finish({})


def test_an_error_in_log_warns_once_and_turns_the_backend_off(registry, tmp_path):
    fake = FakeWandb(FakeRun(fail_log=True))
    backend = make(registry, tmp_path / "run", fake)
    backend.start({}, [])
    with pytest.warns(WandbBackendWarning, match=r"failed to log step 1 \(OSError: broken pipe to the W&B service\)"):
        backend.log(1, {"loss": 1.0})
    fake.run.fail_log = False
    backend.log(2, {"loss": 0.5})  # off: nothing more reaches W&B
    backend.finish({"final_loss": 0.5})
    assert fake.run.logged == []
    assert fake.run.summary == {}  # the summary of a broken run is not written
    assert fake.run.finished_with == [1]  # closed at the end, marked failed


def test_an_error_in_finish_warns_instead_of_raising(registry, tmp_path):
    fake = FakeWandb(FakeRun(fail_finish=True))
    backend = make(registry, tmp_path / "run", fake)
    backend.start({}, [])
    backend.log(1, {"loss": 1.0})
    with pytest.warns(WandbBackendWarning, match=r"failed to finish the run \(TimeoutError: W&B did not finish"):
        backend.finish({"final_loss": 1.0})
    assert fake.run.summary == {"final_loss": 1.0}
    assert fake.run.finished_with == [0]  # tried once, not again


def test_the_training_status_decides_the_exit_code_wandb_records(wandb_manager, tmp_path):
    for status, exit_code in [("completed", 0), ("interrupted", 1), ("failed", 1)]:
        run_dir = tmp_path / status
        fake = FakeWandb()
        backend = make(wandb_manager.registry, run_dir, fake)
        backend.start({}, [])
        wandb_manager.hook.forge_lm_train_end(context=SimpleNamespace(run_dir=run_dir), status=status)
        backend.finish({})
        assert fake.run.finished_with == [exit_code], status


def test_a_run_that_cannot_start_keeps_the_restored_run_id_for_the_next_checkpoint(wandb_manager, tmp_path):
    context = SimpleNamespace(run_dir=tmp_path / "run")
    wandb_manager.load_states(context, {"wandb": {"run_id": "abc123"}})
    fake = FakeWandb(error=RuntimeError("no network"))
    backend = make(wandb_manager.registry, tmp_path / "run", fake)
    with pytest.warns(WandbBackendWarning, match=r"could not start a run \(RuntimeError: no network\)"):
        backend.start({}, [])
    assert (fake.init_arguments[0]["id"], fake.init_arguments[0]["resume"]) == ("abc123", "allow")
    backend.log(1, {"loss": 1.0})
    # A later resume still finds the W&B run: the checkpoint keeps its id.
    assert wandb_manager.save_states(context) == {"wandb": {"run_id": "abc123"}}
    backend.finish({})
    assert wandb_manager.save_states(context) == {}  # the run is over: nothing carried to another


def test_disabled_mode_keeps_the_restored_run_id_instead_of_a_throwaway_one(wandb_manager, tmp_path):
    import wandb

    context = SimpleNamespace(run_dir=tmp_path / "run")
    wandb_manager.load_states(context, {"wandb": {"run_id": "abc123"}})
    backend = make(wandb_manager.registry, tmp_path / "run", wandb, mode="disabled")
    backend.start({}, [])
    assert backend.run.disabled  # W&B's no-op run, with an id of its own
    backend.log(1, {"loss": 1.0})
    assert wandb_manager.save_states(context) == {"wandb": {"run_id": "abc123"}}
    backend.finish({})
    assert offline.run_files(tmp_path) == []
