"""``[train] precision = "fp16"``: float16 autocast with a dynamic loss scale, on CPU.

One shared run (module fixture) overflows once on purpose: a test loss plugin turns the
logits' gradient to Inf on a chosen call while the loss itself stays finite, which is what an
fp16 overflow looks like to the loop. The run's records answer several tests: the step is
skipped and not counted, the scale backs off and grows, the event log says so, a resume goes
on bitwise.
"""

from __future__ import annotations

import json
import math

import attrs
import pytest
import torch
import torch.nn.functional as F

from forge_lm import hookimpl
from forge_lm.config import load_config
from forge_lm.errors import ConfigError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.train import train
from forge_lm.train.loss_scale import LossScaler

FP16 = (
    *TINY_MODEL,
    "--train.batch_size=4",
    "--train.seq_len=16",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",  # the loss is called by the steps alone: call N is a known step's
    "--data.name=synthetic",
    "--scheduler.name=constant",  # a schedule that does not depend on max_steps: a resume may lengthen the run
    "--scheduler.warmup_steps=4",  # the learning rate moves each step: a skipped step would show
    "--train.precision=fp16",
    "--train.loss_scale.init_scale=1024",
    "--train.loss_scale.growth_interval=2",
)
OVERFLOW_AT_CALL = 3  # the loss's third call: the first try of step 3


@attrs.define
class OverflowAtOptions:
    call: int = 0  # 0: never


class _OverflowAt:
    """Cross-entropy; on call ``call`` the gradient flowing back into the logits is Inf (the loss stays finite)."""

    def __init__(self, call: int) -> None:
        self.call, self.count = call, 0

    def __call__(self, logits, labels):
        self.count += 1
        if self.count == self.call:
            logits.register_hook(lambda grad: grad * math.inf)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


@attrs.define
class _Watcher:
    """The model and the scheduler at each step's end and at each skipped step."""

    FORGE_LM_PLUGIN_API = ">=1,<2"
    ends: dict = attrs.Factory(dict)
    skipped: list = attrs.Factory(list)

    @staticmethod
    def _seen(context):
        weights = {name: p.detach().clone() for name, p in context.model.named_parameters()}
        return weights, context.scheduler.last_epoch, context.optimizer.param_groups[0]["lr"]

    @hookimpl
    def forge_lm_register_losses(self, register):
        register("overflow_at", lambda o: _OverflowAt(o.call), config=OverflowAtOptions, description="Inf grads")

    @hookimpl
    def forge_lm_step_end(self, context, step):
        self.ends[step] = self._seen(context)

    @hookimpl
    def forge_lm_step_skipped(self, context, step):
        self.skipped.append((step, self._seen(context), context.loss_scaler.scale))


def _manager() -> PluginManager:
    return PluginManager(PluginSettings(autoload=False))  # the built-ins only, as the suite's `manager` fixture


def _config(manager: PluginManager, run_dir, *overrides: str):
    return load_config(None, [*FP16, f"--train.output_dir={run_dir}", *overrides], manager.registry)


@pytest.fixture(scope="module")
def overflowed(tmp_path_factory):
    """Five fp16 steps with an overflow at the third: the run directory and the watcher."""
    manager, watcher = _manager(), _Watcher()
    manager.add_plugin(watcher, "watcher")
    run_dir = tmp_path_factory.mktemp("fp16") / "run"
    overrides = ["--loss.name=overflow_at", f"--loss.call={OVERFLOW_AT_CALL}", "--train.max_steps=5"]
    result = train(_config(manager, run_dir, *overrides), manager)
    return result, watcher, manager, overrides


def _records(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def test_an_overflow_skips_exactly_that_step(overflowed):
    result, watcher, _, _ = overflowed
    assert result.steps == 5
    assert result.status == "completed"
    ((step, (weights, last_epoch, lr), scale),) = watcher.skipped  # one skip, between steps 2 and 3
    assert step == 2
    before_weights, before_epoch, before_lr = watcher.ends[2]
    assert all(torch.equal(weights[name], before_weights[name]) for name in weights)  # no optimizer step
    assert (last_epoch, lr) == (before_epoch, before_lr)  # no scheduler step
    assert [r["step"] for r in _records(result.run_dir)] == [1, 2, 3, 4, 5]  # the retried step is step 3
    assert scale == 1024.0  # 2048 (grown after steps 1 and 2), halved


def test_the_scale_backs_off_and_grows_as_gradscaler_and_the_event_log_says_so(overflowed):
    result, *_ = overflowed
    # Logged after each step: the scale the next step uses. Growth every 2 clean steps; the
    # overflow halves it and restarts the count.
    assert [r["loss_scale"] for r in _records(result.run_dir)] == [1024.0, 2048.0, 1024.0, 2048.0, 2048.0]
    lines = [json.loads(line) for line in (result.run_dir / "events.jsonl").read_text().splitlines()]
    (event,) = [e for e in lines if e["type"] == "overflow"]
    assert (event["step"], event["scale"], event["new_scale"]) == (2, 2048.0, 1024.0)
    assert event["grad_norm"] in ("inf", "nan")
    assert math.isfinite(event["loss"])
    assert not [e for e in lines if e["type"] == "nonfinite_step"]  # an overflow is not a bad step


def test_the_logged_grad_norm_is_of_unscaled_gradients(overflowed):
    """The first step's norm equals that of the same step in fp32 within fp16's error, not 1024 times it."""
    result, _, manager, _ = overflowed
    fp16_norm = _records(result.run_dir)[0]["grad_norm"]
    reference = train(
        _config(manager, result.run_dir.parent / "fp32", "--train.precision=fp32", "--train.max_steps=1"), manager
    )
    fp32_norm = _records(reference.run_dir)[0]["grad_norm"]
    assert fp16_norm == pytest.approx(fp32_norm, rel=2e-2)


def test_resume_restores_the_scale_bitwise(overflowed, tmp_path):
    result, _, manager, overrides = overflowed
    run_dir = tmp_path / "run"
    shorter = [o for o in overrides if not o.startswith("--train.max_steps")]
    train(_config(manager, run_dir, *shorter, "--train.max_steps=3"), manager)
    saved = json.loads((run_dir / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert saved["trainer"]["loss_scale"] == {"scale": 1024.0, "growth_tracker": 1}
    longer = load_config(run_dir / "config.toml", ["--train.max_steps=5"], manager.registry)
    train(longer, manager)
    whole = {r["step"]: (r["loss"], r["loss_scale"]) for r in _records(result.run_dir)}
    resumed = {r["step"]: (r["loss"], r["loss_scale"]) for r in _records(run_dir)}
    assert resumed == whole  # steps 4 and 5 after the resume: same losses and scales, exactly


def test_fp16_losses_follow_fp32_on_the_debug_config(tmp_path):
    """The debug model (dim 64, 2 layers) for 4 steps: fp16 autocast within 1% of fp32 at each step."""
    manager = _manager()
    losses = {}
    for precision in ("fp32", "fp16"):
        config = load_config(
            "configs/debug.toml",
            [
                f"--train.output_dir={tmp_path / precision}",
                f"--train.precision={precision}",
                "--train.max_steps=4",
                "--train.seq_len=32",
                "--checkpoint.interval=0",
                '--metrics.backends=["jsonl"]',
                "--metrics.peak_flops=1e12",
                "--eval.interval=0",
            ],
            manager.registry,
        )
        losses[precision] = [r["loss"] for r in _records(train(config, manager).run_dir)]
    assert len(losses["fp16"]) == 4
    assert losses["fp16"] == pytest.approx(losses["fp32"], rel=1e-2)
    assert losses["fp16"] != losses["fp32"]  # fp16 did compute in fp16


def test_the_scaler_follows_torch_gradscaler():
    """The scale and growth count after each of a sequence of clean and overflowing steps, against
    ``torch.amp.GradScaler`` on CPU (above the floor, where the two rules are the same)."""
    options = attrs.make_class("Options", ["init_scale", "growth_factor", "backoff_factor", "growth_interval"])
    ours = LossScaler(options(256.0, 3.0, 0.25, 3))
    reference = torch.amp.GradScaler("cpu", init_scale=256.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=3)
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    for overflow in [False, False, True, False, False, False, False, True, True, False, False, False]:
        weight.grad = torch.tensor([math.inf if overflow else 1.0, 1.0])
        reference.scale(torch.ones(()))  # GradScaler's scale is created lazily, by its first use
        reference.unscale_(optimizer)
        reference.step(optimizer)
        reference.update()
        if overflow:
            assert ours.overflowed(1.0, math.inf)
        else:
            ours.stepped()
        assert ours.scale == reference.get_scale()
        assert ours.growth_tracker == reference._get_growth_tracker()


def test_at_the_floor_an_overflow_is_a_bad_step_and_a_nan_loss_always_is():
    options = attrs.make_class("Options", ["init_scale", "growth_factor", "backoff_factor", "growth_interval"])
    scaler = LossScaler(options(2.0, 2.0, 0.5, 10))
    assert scaler.overflowed(1.0, math.inf)
    assert scaler.scale == 1.0
    assert not scaler.overflowed(1.0, math.inf)
    assert scaler.scale == 1.0
    assert not LossScaler(options(8.0, 2.0, 0.5, 10)).overflowed(math.nan, math.inf)  # a NaN loss is never an overflow


@pytest.mark.parametrize(
    "state",
    [{"scale": "big", "growth_tracker": 0}, {"scale": math.inf, "growth_tracker": 0}, {"scale": 4.0}, [1]],
)
def test_a_tampered_scaler_state_is_refused(state):
    options = attrs.make_class("Options", ["init_scale", "growth_factor", "backoff_factor", "growth_interval"])
    with pytest.raises(ValueError, match="loss scale"):
        LossScaler(options(8.0, 2.0, 0.5, 10)).load_state_dict(state)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--train.loss_scale.backoff_factor=1.5", "backoff_factor"),
        ("--train.loss_scale.growth_factor=1.0", "growth_factor"),
        ("--train.loss_scale.init_scale=0", "init_scale"),
        ("--distributed.pp=2", "pipeline"),
    ],
)
def test_bad_fp16_settings_are_refused_naming_them(override, message):
    manager = _manager()
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*FP16, override], manager.registry)
