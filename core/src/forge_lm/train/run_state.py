"""A run's state in a checkpoint, beyond the model and optimizer: saving it and restoring it.

What is restored comes from a file anyone could have edited. The scheduler's and data
loader's saved states must have the shape of the live objects' own (:func:`check_like`),
checked inside the checkpoint manager's attempt, so that a tampered one is passed over like a
damaged checkpoint and an older one used, instead of planting a string where a number belongs.
The optimizer's settings come from this run's config (the manager takes them from the live
optimizer); a saved setting that differs from the live one, while the optimizer settings the
checkpoint records are this run's, was edited: that checkpoint is passed over too.
Plugin states go to their plugins' ``load_state`` hooks, whose failure is the plugin's (exit 4).

Because a resume demands that shape, every save checks it first (:func:`save_run`): the
scheduler's and the dataset's states must be plain JSON data and have the shape their
``state_dict()`` had when the component was built (the run's :class:`StateShapes`, taken right
after they were built, before any step or resume). A state that does not is not written:
it would make every checkpoint of the run unusable. The run stops at that save naming the
component and its plugin (exit 4, the previous checkpoint intact), or, for a core component,
as a bug in Forge. Plugin states follow no shape rule: their ``load_state`` checks them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from forge_lm import events
from forge_lm.checkpoint import CheckpointManager, PerRank
from forge_lm.checkpoint._safe import DamagedCheckpointError
from forge_lm.checkpoint._state import TRAINER_STATE, check_like
from forge_lm.config import structure_config, to_data
from forge_lm.data.loader import BatchLoader
from forge_lm.distributed import is_main_process
from forge_lm.distributed.compression import compressor_of
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.model.freezing import staged_parameters_trainable
from forge_lm.notices import warn
from forge_lm.plain_data import copy_containers, find_not_plain
from forge_lm.plugins import PluginHookFailed, PluginManager, PluginStatus
from forge_lm.train.resume_rules import CONFIG_FILE, FIXED_ON_RESUME, differences

SHAPE_RULE = "a state_dict must keep the shape it had when the component was built: same keys, same kinds of values"
PLAIN_RULE = (
    "a state_dict must be plain JSON data: dicts with string keys, lists, strings, integers, finite floats, "
    "booleans and None"
)
# The hook a failed check is reported under: the failure is in saving state, so the loop's stop
# (train.ending.stop_for_plugin) keeps the checkpoint that exists instead of trying this save again.
_SAVE_HOOK = "forge_lm_save_state"


class ComponentStateBug(ForgeError):
    """A core component's ``state_dict()`` broke the state rules: a bug in Forge, not the user's."""


class StateShapes:
    """The states the scheduler and the data loader had right after they were built (before any
    step, before a resume loads into them): the shapes a resume demands, which every save is
    checked against. One per run (:class:`forge_lm.train.run.Run` holds it); copies, so that a
    component changing the dict its ``state_dict()`` handed out does not change the reference."""

    def __init__(self, scheduler: Any, train_batches: BatchLoader) -> None:
        self.scheduler = copy_containers(scheduler.state_dict())
        self.data = copy_containers(train_batches.state_dict())


def save_run(
    checkpoints: CheckpointManager,
    context: Any,
    train_batches: BatchLoader,
    manager: PluginManager,
    shapes: StateShapes,
) -> None:
    """Checkpoint the run at ``context.step``: the training point, for an exact resume. The
    scheduler's and the data position's states are checked first against ``shapes`` (the module
    docstring): one that a resume would refuse stops the run here, with nothing written."""
    scheduler, data = context.scheduler.state_dict(), train_batches.state_dict()
    _check_state(context, checkpoints, "scheduler", scheduler, shapes.scheduler, equal_lengths=True)
    _check_data_position(context, checkpoints, data, shapes.data)
    state = {
        "config": to_data(context.config),  # what produced it, even if the run directory is lost
        "manifest": manager.manifest(),
        "tokens_seen": context.tokens_seen,
        "tokens_per_step": context.tokens_per_step,
        "scheduler": scheduler,
        "data": data,
        "plugins": manager.save_states(context),
    }
    scaler = getattr(context, "loss_scaler", None)
    if scaler is not None:  # precision = "fp16": the scale goes on where it was
        state["loss_scale"] = scaler.state_dict()
    detector = getattr(context, "spike_detector", None)
    if detector is not None:  # [resilience] spike_policy: a resume judges with the same window
        state["spikes"] = detector.state_dict()
    compressor = compressor_of(context.model)
    if compressor is not None:  # [distributed.compression]: each rank's error feedback and warm start
        state["grad_compression"] = PerRank(compressor.state_dict())  # a resume reads back this rank's only
    checkpoints.save(context.step, context.model, context.optimizer, state)


def restore_run(
    checkpoints: CheckpointManager,
    context: Any,
    train_batches: BatchLoader,
    manager: PluginManager,
    *,
    at_start: bool = True,
) -> bool:
    """Load the newest usable checkpoint into the run; False when there is none (which a start
    reports: it starts from step 0; a rollback's caller says what follows)."""

    def restore(state: dict[str, Any]) -> None:
        missing = {"tokens_seen", "plugins"} - set(state)
        if missing:
            raise ValueError(f"its trainer state lacks {', '.join(sorted(missing))}")
        _check_optimizer_settings(state, context.config)
        scaler = getattr(context, "loss_scaler", None)  # precision = "fp16"
        scaler_state = None  # absent: a checkpoint of a bf16/fp32 run; the scale starts at init_scale
        if scaler is not None and "loss_scale" in state:
            scaler_state = scaler.checked_state(state["loss_scale"])  # before anything is loaded
        detector = getattr(context, "spike_detector", None)  # absent: saved without a spike policy
        spikes_state = detector.checked_state(state["spikes"]) if detector is not None and "spikes" in state else None
        compressor = compressor_of(context.model)
        if compressor is not None:  # a damaged state raises ValueError: the checkpoint is passed over
            note = compressor.load_state_dict(state.get("grad_compression"))
            if note is not None:
                _warn(f"gradient compression: {note}")
        if "scheduler" in state:  # absent in an imported model's step 0: schedule and data start fresh
            with _naming(context, "scheduler"):
                check_like(
                    state["scheduler"], context.scheduler.state_dict(), "the scheduler state", equal_lengths=True
                )
            with _naming(context, "data"):
                check_like(state.get("data"), train_batches.state_dict(), "the data position")
            context.scheduler.load_state_dict(state["scheduler"])
            train_batches.load_state_dict(state["data"])
        if scaler_state is not None:
            scaler.load_state_dict(scaler_state)
        if spikes_state is not None:
            detector.load_state_dict(spikes_state)

    # Staged parameters trainable while loading: the optimizer's state has a place for those that
    # had started training when the checkpoint was written (forge_lm.model.freezing).
    with staged_parameters_trainable(context.model):
        state = checkpoints.load(context.model, context.optimizer, restore)
    if state is None:
        if at_start:
            _warn(f"'{context.run_dir}' has no checkpoint yet; starting from step 0")
        return False
    _check_fixed_settings(state, context, manager)
    for skipped in state["passed_over"]:
        _warn(f"passed over checkpoint {skipped}")
        name, _, reason = skipped.partition(": ")
        events.record("checkpoint_skipped", checkpoint=name, reason=reason)
    context.step, context.tokens_seen = state["step"], state["tokens_seen"]
    saved_batch = state.get("tokens_per_step", context.tokens_per_step)
    if saved_batch != context.tokens_per_step:  # e.g. resumed on another number of ranks
        _warn(
            f"the global batch changed from {saved_batch} to {context.tokens_per_step} tokens per step "
            "(batch_size x grad_accum_steps x seq_len x data-parallel ranks); the run goes on with the new one"
        )
    unclaimed = manager.load_states(context, state["plugins"])
    for name in unclaimed:
        _warn(f"checkpoint state of plugin '{name}' was not restored: {_why_unclaimed(manager, name)}")
    if is_main_process():  # every rank resumed the same checkpoint: the run says it once
        print(f"resumed from {state['path']} (step {context.step})", file=sys.stderr, flush=True)
    events.set_step(context.step)
    events.record("resume", from_step=context.step, checkpoint=Path(state["path"]).name)
    return True


def _why_unclaimed(manager: PluginManager, name: str) -> str:
    """Why no plugin took the saved state of plugin ``name``: it may well be loaded, and only
    lack the hook that restores a state (a version that saves but does not restore)."""
    plugin = next((p for p in manager.plugins if p.name == name), None)
    if plugin is None:
        return "no plugin of that name is installed"
    if plugin.status is PluginStatus.OK:
        return f"{plugin.label} is loaded but has no forge_lm_load_state hook: it goes on without the state it saved"
    return f"{plugin.label} is not loaded ({plugin.status}{': ' + plugin.reason if plugin.reason else ''})"


def roll_back(
    checkpoints: CheckpointManager, context: Any, train_batches: BatchLoader, manager: PluginManager
) -> int | None:
    """``nan_policy = "rollback"``: restore the newest checkpoint but keep the data position, so
    that the run goes on past the data read since (not back to the batch that broke it). The
    step restored, or None when there is no checkpoint. A ``rollback`` event names the loader
    batches skipped: those read after the checkpoint's position, up to the one read last."""
    checkpoints.wait()
    data_position = train_batches.state_dict()
    if not restore_run(checkpoints, context, train_batches, manager, at_start=False):
        return None
    skipped = [train_batches.batches + 1, data_position["batches"]]  # the checkpoint's position, then now
    train_batches.load_state_dict(data_position)
    events.record("rollback", to_step=context.step, skipped_batches=skipped)
    return context.step


class _naming:
    """A check_like failure inside it says which component's state it was (and from which plugin)."""

    def __init__(self, context: Any, category: str) -> None:
        self.context, self.category = context, category

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> bool:
        if isinstance(error, DamagedCheckpointError):
            kind_name, name, plugin = _component(self.context, self.category)
            source = f" from {plugin.label}" if plugin is not None else ""
            raise DamagedCheckpointError(f"{error} (the state of the {kind_name} '{name}'{source})") from None
        return False


def _component(context: Any, category: str) -> tuple[str, str, Any]:
    """``(kind, name, plugin)`` of the run's scheduler or dataset (``category``: "scheduler" or
    "data"); ``plugin`` is None when the config does not say (not loaded through load_config)."""
    chosen = getattr(context.config, category, None)
    kind = "scheduler" if category == "scheduler" else "dataset"
    component = getattr(chosen, "component", None)
    return kind, str(getattr(chosen, "name", "?")), getattr(component, "plugin", None)


def _check_data_position(context: Any, checkpoints: CheckpointManager, data: Any, reference: Any) -> None:
    """The data loader's state: the dataset's part is the dataset's (its plugin's), the rest the core's."""
    if isinstance(data, dict) and isinstance(reference, dict) and "dataset" in data and "dataset" in reference:
        _check_state(context, checkpoints, "data", data["dataset"], reference["dataset"])
        rest = {key: value for key, value in data.items() if key != "dataset"}
        reference = {key: value for key, value in reference.items() if key != "dataset"}
        _check_state(context, checkpoints, None, rest, reference)
    else:
        _check_state(context, checkpoints, None, data, reference)


def _check_state(
    context: Any, checkpoints: CheckpointManager, category: str | None, state: Any, reference: Any, **options: Any
) -> None:
    """``state`` is plain JSON data with the shape of ``reference`` (check_like, with the options
    restore_run uses); else the run stops, blaming the component of ``category`` (None: the core's
    data loader)."""
    problem, rule = _plain_problem(state), PLAIN_RULE
    if problem is None:
        rule = SHAPE_RULE
        try:
            check_like(state, reference, "state_dict()", **options)
        except DamagedCheckpointError as exc:
            problem = f"{str(exc).removeprefix(f'{TRAINER_STATE}: ')} (as it was when the component was built)"
    if problem is None:
        return
    kind, name, plugin = ("data loader", "BatchLoader", None) if category is None else _component(context, category)
    core = plugin is None or plugin.builtin
    what = f"{kind} '{name}', whose state at step {context.step} a resume could not load: {problem}. Rule: {rule}"
    if not core:
        raise PluginHookFailed(plugin, _SAVE_HOOK, f"provides the {what}")
    try:
        newest = checkpoints.latest()
    except OSError:
        newest = None
    intact = f"the newest checkpoint ({newest.name}) is intact" if newest else "no checkpoint was written yet"
    source = f"{plugin.distribution} {plugin.version}" if plugin is not None else "the core"
    raise ComponentStateBug(
        f"the core's {what}. This is a bug in Forge ({source}), not in the run: please report it. Training stopped "
        f"at step {context.step} without saving it; {intact}"
    )


def _plain_problem(state: Any) -> str | None:
    """What in ``state`` (a component's state) is not plain JSON data, or None; its top is a dict."""
    if not isinstance(state, dict):
        return f"state_dict() is a {type(state).__name__}, not a dict"
    found = find_not_plain(state)  # finite numbers, string keys, MAX_DEPTH levels at most
    return None if found is None else found.describe("state_dict()")


def _check_fixed_settings(state: dict[str, Any], context: Any, manager: PluginManager) -> None:
    """The settings a resumed run cannot change, against the config the checkpoint records (the
    run directory's ``config.toml`` was compared already, but it may have been edited since)."""
    recorded = state.get("config")
    if not isinstance(recorded, dict) or not recorded:  # an imported model's step 0 records none
        return
    try:  # filled with today's defaults, as the run directory's config.toml is
        recorded = json.loads(json.dumps(to_data(structure_config(recorded, manager.registry))))
    except (ConfigError, TypeError, ValueError):
        return  # a config this version cannot read: the run directory's comparison stands
    live = json.loads(json.dumps(to_data(context.config)))
    changed = [key for key in differences(recorded, live) if key.startswith(FIXED_ON_RESUME)]
    if not changed:
        return
    shown = "; ".join(f"{key} = {_at(recorded, key)!r} there, {_at(live, key)!r} here" for key in changed[:3])
    raise ConfigError(
        f"[train] output_dir: checkpoint {Path(state['path']).name} of '{context.run_dir}' was written with other "
        f"settings for {', '.join(changed)} ({shown}); a resumed run cannot change them, and its {CONFIG_FILE} "
        f"says otherwise than the checkpoint (was it edited?). Put them back in '{context.run_dir / CONFIG_FILE}', "
        "or choose a new train.output_dir."
    )


def _at(tree: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def _check_optimizer_settings(state: dict[str, Any], config: Any) -> None:
    """A setting of the saved optimizer that differs from the live one's is fine when the run's
    optimizer settings changed since the checkpoint (the config wins); when they are the ones the
    checkpoint records, the saved value was edited."""
    replaced = state.get("settings_from_config") or []
    recorded = state.get("config")
    if not replaced or not isinstance(recorded, dict):
        return
    live = json.loads(json.dumps(to_data(config).get("optimizer")))
    if recorded.get("optimizer") == live:
        raise DamagedCheckpointError(
            f"{TRAINER_STATE}: {replaced[0]} differs from what the run's optimizer settings (which the checkpoint "
            "records, unchanged) give it; the file was edited"
        )


def _warn(message: str) -> None:
    """A warning about the run as a whole (the checkpoint every rank resumed): rank 0 says it."""
    if is_main_process():
        warn(message)
