"""The training loop: what it computes and what it writes, checked against references."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from forge_lm import hookimpl
from forge_lm.config import load_config
from forge_lm.errors import ConfigError
from forge_lm.losses.aux import report_aux_loss, report_metric
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.train import train


def test_run_directory_holds_resolved_config_manifest_metrics_and_a_checkpoint(tiny_config, manager):
    config = tiny_config()
    result = train(config, manager)
    run_dir = result.run_dir
    assert result.steps == 6
    assert load_config(run_dir / "config.toml", [], manager.registry) == config
    assert json.loads((run_dir / "plugins.json").read_text()) == manager.manifest()
    records = read_metrics(run_dir / "metrics.jsonl")
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4, 5, 6]
    for record in train_records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "memory/rss_gib"} <= record.keys()
        assert 0.05 < record["memory/rss_gib"] < 64  # this process: an interpreter with torch, not nothing
        assert math.isfinite(record["loss"])
        assert record["tokens_per_sec"] > 0
        assert record["mfu"] > 0
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(r["eval/perplexity"] == pytest.approx(math.exp(r["eval/loss"])) for r in evals)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_6"
    state = json.loads((run_dir / "checkpoints" / "step_6" / "trainer_state.json").read_text())
    assert state["step"] == 6


def test_logged_learning_rate_follows_the_schedule_and_never_starts_at_zero(tiny_config, manager):
    config = tiny_config("--scheduler.name=cosine", "--scheduler.warmup_steps=3", "--optimizer.lr=0.01")
    run_dir = train(config, manager).run_dir
    lrs = [r["lr"] for r in read_metrics(run_dir / "metrics.jsonl") if "lr" in r]
    assert lrs[:3] == pytest.approx([0.01 / 3, 0.02 / 3, 0.01])  # warmup (s + 1) / W: first step above 0
    decay = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 3) / 3)) for s in (3, 4, 5)]
    assert lrs[3:] == pytest.approx([0.01 * f for f in decay])


def test_first_logged_loss_equals_the_loss_of_the_initial_model_on_the_first_batch(tiny_config, manager):
    from forge_lm.data.loader import BatchLoader
    from forge_lm.model import build_model
    from forge_lm.train.builders import build_dataset

    config = tiny_config("--train.max_steps=1")
    torch.manual_seed(config.train.seed)
    model = build_model(config.model, 257, manager.registry)
    batch = next(iter(BatchLoader(build_dataset(config, manager.registry, None, 257, "train"), 4)))
    logits = model(batch["input_ids"], batch.get("document_ids"))
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
    record = read_metrics(train(config, manager).run_dir / "metrics.jsonl")[0]
    assert record["loss"] == pytest.approx(expected, rel=1e-6)


def _parameters_after_one_step(config, manager):
    captured = {}

    class Capture:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl
        def forge_lm_train_end(self, context):
            captured.update({k: v.detach().clone() for k, v in context.model.state_dict().items()})

    manager.add_plugin(Capture(), f"capture{id(config)}")
    train(config, manager)
    return captured


def test_gradient_accumulation_equals_one_big_batch(tiny_config, manager):
    big = _parameters_after_one_step(tiny_config("--train.max_steps=1", "--train.batch_size=8"), manager)
    from forge_lm.plugins import PluginManager, PluginSettings

    other = PluginManager(PluginSettings(autoload=False))
    accumulated = _parameters_after_one_step(
        tiny_config("--train.max_steps=1", "--train.batch_size=4", "--train.grad_accum_steps=2", manager=other), other
    )
    for name, value in big.items():
        torch.testing.assert_close(accumulated[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_autocast_keeps_fp32_master_weights(tiny_config, manager):
    weights = _parameters_after_one_step(tiny_config("--train.precision=bf16", "--train.max_steps=2"), manager)
    assert {value.dtype for value in weights.values()} == {torch.float32}


class _PlainSgdPlugin:
    """SGD without momentum or decay: its update is ``-lr * gradient``, so it shows the clipped gradient."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    @hookimpl
    def forge_lm_register_optimizers(self, register):
        register("plain_sgd", lambda options, model: torch.optim.SGD(model.parameters(), lr=0.5), description="SGD")


def test_gradient_clipping_bounds_the_update_and_logs_the_unclipped_norm(tiny_config, manager):
    from forge_lm.data.loader import BatchLoader
    from forge_lm.model import build_model
    from forge_lm.train.builders import build_dataset

    lr, max_norm = 0.5, 0.05
    manager.add_plugin(_PlainSgdPlugin(), "plain_sgd")
    config = tiny_config(
        f"--train.grad_clip={max_norm}", "--train.max_steps=1", "--optimizer.name=plain_sgd", "--scheduler.name=none"
    )
    # By hand: the initial model's gradient on the first batch, its norm, and the clipped SGD step.
    torch.manual_seed(config.train.seed)
    model = build_model(config.model, 257, manager.registry)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batch = next(iter(BatchLoader(build_dataset(config, manager.registry, None, 257, "train"), 4)))
    logits = model(batch["input_ids"], batch.get("document_ids"))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()
    assert norm > 10 * max_norm  # so the clip really acts

    after = _parameters_after_one_step(config, manager)
    record = read_metrics(Path(config.train.output_dir) / "metrics.jsonl")[0]
    assert record["grad_norm"] == pytest.approx(norm, rel=1e-5)  # the norm before clipping is what is logged
    scale = max_norm / (norm + 1e-6)  # torch's clip factor
    updates = {name: after[name] - before[name] for name in grads}
    for name, grad in grads.items():
        torch.testing.assert_close(updates[name], -lr * scale * grad, rtol=1e-4, atol=1e-7, msg=name)
    update_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(u) for u in updates.values()]))
    assert update_norm.item() == pytest.approx(lr * max_norm, rel=1e-4)  # the step is bounded by lr * grad_clip


class _AuxFeedForward(torch.nn.Module):
    """A feed-forward layer that reports an auxiliary loss and a statistic, like an MoE router."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.proj(x)
        report_aux_loss("aux/penalty", 0.5 * out.square().mean())
        report_metric("aux/mean_abs", out.abs().mean())
        return out


class _AuxPlugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    @hookimpl
    def forge_lm_register_feed_forwards(self, register):
        register("aux_ffn", lambda options, dim, layer: _AuxFeedForward(dim), description="reports aux losses")


def test_auxiliary_losses_reach_the_gradient_once_and_are_logged(tiny_config, manager, one_process_parts):
    from forge_lm.train.step import compute_gradients

    manager.add_plugin(_AuxPlugin(), "aux")
    config = tiny_config("--model.ffn.name=aux_ffn", "--train.grad_clip=0")  # unclipped, like the reference
    from forge_lm.data.loader import BatchLoader
    from forge_lm.model import build_model
    from forge_lm.train.builders import build_dataset

    def fresh():
        torch.manual_seed(0)
        model = build_model(config.model, 257, manager.registry)
        batches = iter(BatchLoader(build_dataset(config, manager.registry, None, 257, "train"), 4))
        return model, batches

    model, batches = fresh()
    loss, _, reports = compute_gradients(one_process_parts(model, config), batches, config)
    loss, aux = loss.item(), reports.logged()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    reference, ref_batches = fresh()
    batch = next(ref_batches)
    hidden_penalties = []
    for layer in reference.layers:  # the penalty each feed-forward reports, computed by hand
        layer.feed_forward.register_forward_hook(lambda m, i, o: hidden_penalties.append(0.5 * o.square().mean()))
    logits = reference(batch["input_ids"], batch.get("document_ids"))
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    (ce + sum(hidden_penalties)).backward()

    assert loss == pytest.approx(ce.item(), rel=1e-6)  # the logged loss is the main loss alone
    assert aux["aux/penalty"] == pytest.approx(sum(hidden_penalties).item(), rel=1e-6)
    assert "aux/mean_abs" in aux
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, msg=name)


def test_lifecycle_hooks_run_in_order_with_the_run(tiny_config, manager):
    calls = []

    class Recorder:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl
        def forge_lm_train_start(self, context):
            calls.append(("start", context.step))

        @hookimpl
        def forge_lm_step_end(self, step, metrics):
            calls.append(("step", step))
            return {"recorder/seen": float(step)}

        @hookimpl
        def forge_lm_eval_end(self, step, metrics):
            calls.append(("eval", step, sorted(metrics)))

        @hookimpl
        def forge_lm_save_state(self, context):
            calls.append(("save", context.step))
            return {"seen": context.step}

        @hookimpl
        def forge_lm_train_end(self, status):
            calls.append(("end", status))

    manager.add_plugin(Recorder(), "recorder")
    run_dir = train(tiny_config("--train.max_steps=3", "--checkpoint.interval=2"), manager).run_dir
    evals = ["eval/loss", "eval/perplexity"]
    assert calls == [
        ("start", 0),
        ("step", 1),
        ("step", 2),
        ("save", 2),
        ("step", 3),
        ("eval", 3, evals),
        ("save", 3),
        ("end", "completed"),
    ]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["recorder/seen"] for r in records if "loss" in r] == [1.0, 2.0, 3.0]
    state = json.loads((run_dir / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert state["trainer"]["plugins"] == {"recorder": {"seen": 2}}


def test_a_run_directory_of_another_model_is_refused_and_left_untouched(tiny_config, manager):
    config = tiny_config("--train.max_steps=1")
    run_dir = train(config, manager).run_dir
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    other = load_config(run_dir / "config.toml", ["--model.dim=64"], manager.registry)
    with pytest.raises(ConfigError) as caught:
        train(other, manager)
    assert str(caught.value).startswith(
        f"[train] output_dir: '{run_dir}' holds a run with other settings for model.dim; a resumed run cannot "
        "change them."
    )
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_a_cuda_device_on_a_machine_without_cuda_is_a_config_error(tiny_config, manager, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as caught:
        train(tiny_config("--train.device=cuda"), manager)
    assert str(caught.value) == "[train] device: 'cuda' asked for, but CUDA is not available; use 'cpu' or 'auto'."


def test_a_backend_that_cannot_be_built_stops_the_run_before_anything_is_written(tiny_config, manager):
    from forge_lm.errors import PluginError

    def unavailable(options, context):
        raise PluginError("metrics backend 'remote' needs the remote package: pip install remote")

    class Remote:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl
        def forge_lm_register_metrics_backends(self, register):
            register("remote", unavailable, description="needs a missing package")

    manager.add_plugin(Remote(), "remote")
    config = tiny_config('--metrics.backends=["jsonl", "remote"]')
    with pytest.raises(PluginError, match="pip install remote"):
        train(config, manager)
    assert not Path(config.train.output_dir).exists()
