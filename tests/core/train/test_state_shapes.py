"""Every save checks the scheduler's and the dataset's states against the shapes a resume will
demand (train.run_state.StateShapes, which the run holds): a state that changed shape since the
component was built is refused at that save, naming the component and its plugin, instead of
making every checkpoint of the run unusable. And a resume that passes over a checkpoint for such
a state names the component."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from forge_lm import hookimpl
from forge_lm.config import load_config
from forge_lm.data.loader import BatchLoader
from forge_lm.data.synthetic import SyntheticTokens
from forge_lm.errors import ForgeError
from forge_lm.plugins import PluginHookFailed, PluginInfo
from forge_lm.train import run_state, train
from forge_lm.train.run_state import ComponentStateBug, StateShapes, save_run


class _Data(SyntheticTokens):
    """``last`` is None until the first sample is drawn, an int after: the reviewer's dataset."""

    def state_dict(self):
        return {"next_index": self._start, "last": None if self._start == 0 else self._start}


class _ShapeShifter:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    @hookimpl
    def forge_lm_register_datasets(self, register):
        register("shifting", lambda options, context: _Data(context), description="changes its state's shape")


def test_a_dataset_state_that_changes_shape_before_the_first_save_is_refused_there(tiny_config, manager):
    manager.add_plugin(_ShapeShifter(), "shifter", distribution="forge-shifter", version="1.0")
    config = tiny_config("--data.name=shifting", "--train.max_steps=4", "--checkpoint.interval=2", "--eval.interval=0")
    with pytest.raises(PluginHookFailed) as caught:
        train(config, manager)
    message = str(caught.value)
    assert message.startswith(
        "plugin 'shifter' (forge-shifter 1.0) provides the dataset 'shifting', whose state at step 2 a resume "
        "could not load: state_dict().last is not a boolean"
    )
    assert "a state_dict must keep the shape it had when the component was built: same keys, same kinds" in message
    assert "Training stopped at step 2; no checkpoint was written yet" in message
    assert caught.value.exit_code == 4
    assert not list((Path(config.train.output_dir) / "checkpoints").glob("step_*"))  # nothing half-written


def test_a_well_behaved_run_saves_and_resumes_with_the_check(tiny_config, manager):
    config = tiny_config("--train.max_steps=4", "--checkpoint.interval=2", "--eval.interval=0")
    assert train(config, manager).steps == 4


def test_a_resume_names_the_component_whose_saved_state_does_not_match(tiny_config, manager):
    config = tiny_config("--train.max_steps=2", "--checkpoint.interval=2", "--eval.interval=0")
    run_dir = train(config, manager).run_dir
    state_file = run_dir / "checkpoints" / "step_2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["trainer"]["data"]["dataset"]["extra"] = 1  # edited: a key the live dataset's state lacks
    state_file.write_text(json.dumps(state))
    with pytest.raises(ForgeError) as caught:  # its only checkpoint is passed over
        train(load_config(run_dir / "config.toml", ["--train.max_steps=3"], manager.registry), manager)
    message = str(caught.value)
    assert "step_2: trainer_state.json: the data position.dataset has keys" in message
    assert "(the state of the dataset 'synthetic' from plugin " in message


def _context(plugin: PluginInfo, scheduler) -> SimpleNamespace:
    chosen = SimpleNamespace(name="cosine", component=SimpleNamespace(plugin=plugin))
    data = SimpleNamespace(name="synthetic", component=SimpleNamespace(plugin=plugin))
    return SimpleNamespace(config=SimpleNamespace(scheduler=chosen, data=data), scheduler=scheduler, step=6)


class _Scheduler:
    def __init__(self):
        self.state = {"last_epoch": 0, "base_lrs": [0.1]}

    def state_dict(self):
        return self.state


class _Dataset:
    def state_dict(self):
        return {"next_index": 0}


class _Checkpoints:
    def __init__(self):
        self.saved = []

    def latest(self):
        return SimpleNamespace(name="step_4")

    def save(self, *args):
        self.saved.append(args)


def test_a_core_component_breaking_the_rule_is_reported_as_a_forge_bug():
    core = PluginInfo("builtin", "forge-lm", "9.9", "forge_lm", builtin=True)
    scheduler = _Scheduler()
    context = _context(core, scheduler)
    loader = BatchLoader(_Dataset(), 2, 8, "the data")
    checkpoints = _Checkpoints()
    shapes = StateShapes(scheduler, loader)
    scheduler.state = {"last_epoch": 0, "base_lrs": [0.1], "grown": 1}
    with pytest.raises(ComponentStateBug) as caught:
        save_run(checkpoints, context, loader, SimpleNamespace(), shapes)
    message = str(caught.value)
    assert message.startswith("the core's scheduler 'cosine', whose state at step 6 a resume could not load")
    assert "This is a bug in Forge (forge-lm 9.9)" in message
    assert "the newest checkpoint (step_4) is intact" in message
    assert checkpoints.saved == []


def test_the_reference_is_a_copy_not_the_live_state():
    plugin = PluginInfo("p", "forge-p", "1.0", "p")
    scheduler = _Scheduler()
    context = _context(plugin, scheduler)
    loader = BatchLoader(_Dataset(), 2, 8, "the data")
    shapes = StateShapes(scheduler, loader)
    scheduler.state["new"] = "key"  # the plugin mutates the dict its state_dict() handed out
    with pytest.raises(PluginHookFailed, match=r"state_dict\(\) has keys \['base_lrs', 'last_epoch', 'new'\]"):
        save_run(_Checkpoints(), context, loader, SimpleNamespace(), shapes)
    assert run_state.SHAPE_RULE.startswith("a state_dict must keep the shape")
