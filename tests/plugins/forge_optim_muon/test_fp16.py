"""Muon under ``[train] precision = "fp16"`` (issue 31): it works, because the core divides the
gradients by the loss scale in ``compute_gradients``, before clipping and before the optimizer
step, so Newton-Schulz always runs on true (unscaled) fp32 gradients; and an overflow skips the
step before Muon is called, leaving its momentum untouched.

Three runs of the debug config (dim 64, 2 layers) with ``optimizer.name = "muon"``, each once
per module: fp32, fp16, and fp16 with an Inf injected into one Muon matrix's gradient at the
third backward pass (a gradient hook; the loss stays finite, as in a real fp16 overflow).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest
import torch

import forge_optim_muon.optimizer as muon_optimizer
from forge_lm import hookimpl
from forge_lm.config import load_config
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginManager
from forge_lm.train import train

REPO = Path(__file__).resolve().parents[3]
DEBUG = REPO / "configs" / "debug.toml"
README = REPO / "plugins" / "forge-optim-muon" / "README.md"
STEPS = 6
RUN = [
    "--optimizer.name=muon",
    "--optimizer.lr=0.02",
    "--optimizer.ns_dtype=float32",  # the same Newton-Schulz on every CPU ('auto' picks bf16 on some)
    f"--train.max_steps={STEPS}",
    "--train.seq_len=32",
    "--scheduler.name=constant",
    "--scheduler.warmup_steps=2",
    "--checkpoint.interval=0",
    "--eval.interval=0",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--train.grad_clip=0",  # no clipping: Newton-Schulz gets the gradients as they are (clipping would hide a scale)
    "--train.loss_scale.init_scale=1024",
    "--train.loss_scale.growth_interval=2",  # the scale changes during the run: 1024, 2048, 4096
]
OVERFLOWED = "layers.0.attention.wq.weight"  # a hidden matrix: Muon's side
OVERFLOW_AT_BACKWARD = 3  # the first try of step 3
# Every step's loss of the fp16 run within this fraction of the fp32 run's (measured: 1e-4 at most).
LOSS_TOLERANCE = 1e-3
# Newton-Schulz's first input, fp16 against fp32: its norm within this fraction (a scaled input
# would be 1024 times larger; measured: 7e-5 at most), and its direction (cosine) at least 1 minus it.
INPUT_TOLERANCE = 1e-3


@attrs.define
class _Watcher:
    """What Muon is handed at the first step, the model and Muon's state at each step end and
    skipped step, and (when ``overflow_at``) an Inf in one gradient at that backward pass."""

    FORGE_LM_PLUGIN_API = ">=1,<2"
    overflow_at: int = 0
    backwards: int = 0
    ns_inputs: list = attrs.Factory(list)
    ends: dict = attrs.Factory(dict)
    skipped: list = attrs.Factory(list)

    @staticmethod
    def _seen(context):
        weights = {name: p.detach().clone() for name, p in context.model.named_parameters()}
        optimizer = context.optimizer
        state = {
            name: {key: value.clone() for key, value in optimizer.state[p].items()}
            for name, p in context.model.named_parameters()
        }
        return weights, state

    def _hook(self, grad):
        self.backwards += 1
        return grad * math.inf if self.backwards == self.overflow_at else grad

    @hookimpl
    def forge_lm_train_start(self, context):
        if self.overflow_at:
            context.model.get_parameter(OVERFLOWED).register_hook(self._hook)

    @hookimpl
    def forge_lm_step_end(self, context, step):
        self.ends[step] = self._seen(context)

    @hookimpl
    def forge_lm_step_skipped(self, context, step):
        self.skipped.append({"after step": step, "seen": self._seen(context), "scale": context.loss_scaler.scale})


def _train(tmp_path_factory, monkeypatch_module, name: str, precision: str, overflow_at: int = 0):
    manager, watcher = PluginManager(), _Watcher(overflow_at)
    manager.add_plugin(watcher, "watcher")
    real = muon_optimizer.newton_schulz

    def recording(batch, *args, **kwargs):
        if not watcher.ends:  # the first step's Newton-Schulz inputs
            watcher.ns_inputs.append(batch.detach().clone())
        return real(batch, *args, **kwargs)

    monkeypatch_module.setattr(muon_optimizer, "newton_schulz", recording)
    run_dir = tmp_path_factory.mktemp(name) / "run"
    overrides = [*RUN, f"--train.precision={precision}", f"--train.output_dir={run_dir}"]
    result = train(load_config(DEBUG, overrides, manager.registry), manager)
    monkeypatch_module.setattr(muon_optimizer, "newton_schulz", real)
    assert result.status == "completed"
    return result, watcher


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the package's autouse fixture, which is function-scoped: this one runs first
    try:
        with pytest.MonkeyPatch.context() as patch:
            yield {
                "fp32": _train(tmp_path_factory, patch, "fp32", "fp32"),
                "fp16": _train(tmp_path_factory, patch, "fp16", "fp16"),
                "overflow": _train(tmp_path_factory, patch, "overflow", "fp16", OVERFLOW_AT_BACKWARD),
            }
    finally:
        torch.set_num_threads(threads)


def _records(result):
    return [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "loss" in r]


def test_muon_under_fp16_follows_fp32_on_the_debug_config(runs):
    fp32 = [r["loss"] for r in _records(runs["fp32"][0])]
    fp16 = [r["loss"] for r in _records(runs["fp16"][0])]
    assert len(fp16) == len(fp32) == STEPS
    assert fp16 == pytest.approx(fp32, rel=LOSS_TOLERANCE)
    assert fp16 != fp32  # the forward did run in float16
    assert fp16[-1] < fp16[0] - 0.2  # and Muon trained the model
    scales = [r["loss_scale"] for r in _records(runs["fp16"][0])]
    assert scales == [1024.0, 2048.0, 2048.0, 4096.0, 4096.0, 8192.0]  # grown every 2 steps, as configured


def test_newton_schulz_gets_unscaled_gradients(runs):
    """At the first step (momentum buffer zero) Muon orthogonalises ``(1 - momentum^2) x grad``
    (Nesterov): under fp16 that is the fp32 run's input up to fp16's rounding, not 1024 times it."""
    fp32, fp16 = runs["fp32"][1].ns_inputs, runs["fp16"][1].ns_inputs
    assert len(fp16) == len(fp32) > 0
    for reference, seen in zip(fp32, fp16, strict=True):
        assert seen.dtype == torch.float32
        ratio = (seen.norm() / reference.norm()).item()
        assert ratio == pytest.approx(1.0, abs=INPUT_TOLERANCE)
        cosine = torch.nn.functional.cosine_similarity(seen.flatten(), reference.flatten(), dim=0).item()
        assert cosine > 1 - INPUT_TOLERANCE


def test_an_overflow_skips_the_step_and_leaves_muons_state_alone(runs):
    result, watcher = runs["overflow"]
    assert result.steps == STEPS
    (skipped,) = watcher.skipped
    assert skipped["after step"] == 2  # two steps taken, the third's first try overflowed
    assert skipped["scale"] == 1024.0  # 2048 after steps 1 and 2, halved
    weights, state = skipped["seen"]
    before_weights, before_state = watcher.ends[2]
    for name, weight in weights.items():
        assert torch.equal(weight, before_weights[name]), name
        assert state[name].keys() == before_state[name].keys(), name
        for key, value in state[name].items():
            assert torch.equal(value, before_state[name][key]), f"{name} {key}"
    assert set(state[OVERFLOWED]) == {"momentum_buffer"}  # it is a Muon matrix
    # The next steps are taken, and every weight and momentum buffer stays finite.
    final_weights, final_state = watcher.ends[STEPS]
    assert all(torch.isfinite(w).all() for w in final_weights.values())
    assert all(torch.isfinite(v).all() for s in final_state.values() for v in s.values())
    assert not torch.equal(final_state[OVERFLOWED]["momentum_buffer"], before_state[OVERFLOWED]["momentum_buffer"])
    lines = [json.loads(line) for line in (result.run_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["scale"], e["new_scale"]) for e in lines if e["type"] == "overflow"] == [(2, 2048.0, 1024.0)]
    assert [r["step"] for r in _records(result)] == list(range(1, STEPS + 1))


def test_the_readme_states_the_tested_tolerances():
    text = " ".join(README.read_text(encoding="utf-8").split())
    assert f"every step's loss is within {LOSS_TOLERANCE:.1%} of the fp32 run's" in text
    assert f"equals the fp32 run's to {INPUT_TOLERANCE:.1%}" in text
    assert f"for {STEPS} steps with Muon, clipping off and a loss scale that grows from 1024" in text
