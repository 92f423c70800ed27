"""A llava (configs/vlm_debug.toml, made smaller) on 2 CPU ranks (gloo, real torchrun
processes): the meta-device build with FSDP2 starts from the one-process weights bit for bit,
and FSDP2 trains like one process on the same global batch (losses, gradient norms and the
final weights). Activation checkpointing (full and selective) recomputes the tower's and the
language model's blocks and keeps the gradients and the training run's losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from forge_lm.config import load_config, model_options
from forge_lm.distributed.activation_checkpointing import activation_checkpointing_transform
from forge_lm.distributed.transforms import TransformContext
from forge_lm.model import build_model
from forge_lm.testing.distributed import metrics_by_step, torchrun
from forge_lm.train import train
from forge_lm.train.inference import load_for_inference

REPO = Path(__file__).resolve().parents[3]
DEBUG = REPO / "configs" / "vlm_debug.toml"
WORKER = Path(__file__).parent / "workers" / "meta_init_llava.py"
SIZE = ["--model.language.dim=32", "--model.language.n_layers=1", "--model.vision.depth=2", "--train.seq_len=48"]
# 3 steps at a constant learning rate, every step logged; per-rank batch 2 on 2 ranks = batch 4 here.
SMALL = [*SIZE, "--train.max_steps=3", "--scheduler.name=constant", "--metrics.log_interval=1"]
SMALL += ['--metrics.backends=["jsonl"]', "--metrics.peak_flops=1e12"]


def _two_ranks(*args: str) -> str:
    """torchrun of ``args`` on 2 ranks, which must succeed: its stderr."""
    result = torchrun(list(args), nproc=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stderr


def _one_process(manager, run_dir: Path, *extra: str) -> dict[int, dict[str, float]]:
    config = load_config(
        DEBUG, [*SMALL, "--train.batch_size=4", f"--train.output_dir={run_dir}", *extra], manager.registry
    )
    train(config, manager)
    return metrics_by_step(run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, vlm_manager) -> tuple[Path, dict[int, dict[str, float]]]:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    return run_dir, _one_process(vlm_manager, run_dir)


def _assert_same_training(actual: dict, expected: dict) -> None:
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm"):
            assert actual[step][key] == pytest.approx(expected[step][key], rel=1e-5), (step, key)


def test_the_meta_build_on_two_ranks_starts_from_the_one_process_weights(tmp_path):
    out = tmp_path / "equal.json"
    _two_ranks(str(WORKER), str(out), *SIZE)
    for rank, result in enumerate(json.loads(out.read_text())):
        assert result["mismatched"] == [], rank
        assert result["compared"] == result["reference_tensors"], rank
        assert result["sharded"] == result["parameters"], rank  # every parameter a DTensor
        assert 0.45 < result["local_fraction"] < 0.6, rank  # each rank allocated about half


def test_two_ranks_train_like_one_process(reference, tmp_path, vlm_manager):
    reference_dir, expected = reference
    run_dir = tmp_path / "run"
    args = [str(DEBUG), "--plugins=vlm", *SMALL, "--train.batch_size=2", f"--train.output_dir={run_dir}"]
    stderr = _two_ranks("-m", "forge_lm", "train", *args)
    assert "2 ranks: dp_replicate=1 dp_shard=2 tp=1 pp=1 ep=1; model transforms: fsdp2" in stderr
    _assert_same_training(metrics_by_step(run_dir), expected)
    # the sharded checkpoint, read back in one process, holds the one-process run's weights
    sharded, _, _ = load_for_inference(run_dir, vlm_manager)
    whole, _, _ = load_for_inference(reference_dir, vlm_manager)
    weights = whole.state_dict()
    for name, tensor in sharded.state_dict().items():
        torch.testing.assert_close(tensor, weights[name], atol=1e-5, rtol=1e-4, msg=name)


def test_activation_checkpointing_trains_like_without(reference, tmp_path, vlm_manager):
    _, expected = reference
    actual = _one_process(vlm_manager, tmp_path / "run", "--train.activation_checkpointing=full")
    _assert_same_training(actual, expected)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_the_blocks_and_keeps_the_gradients(mode, vlm_manager):
    config = load_config(DEBUG, [*SIZE, f"--train.activation_checkpointing={mode}"], vlm_manager.registry)
    vocab = model_options(config).vocab_size
    plain = build_model(config.model, vocab, vlm_manager.registry, seed=0)
    checkpointed = build_model(config.model, vocab, vlm_manager.registry, seed=0)
    context = TransformContext(config, None, None, torch.device("cpu"), None)
    activation_checkpointing_transform(None).apply(checkpointed, context)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 259, (2, 40), generator=generator)
    ids[:, 3:19] = 259  # one image of 16 tokens per row
    pixels = torch.randn(2, 3, 16, 16, generator=generator)
    linear_calls = {}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        calls = [0]
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(lambda *_, calls=calls: calls.__setitem__(0, calls[0] + 1))
        model(ids, pixel_values=pixels).float().logsumexp(-1).mean().backward()
        linear_calls[name] = calls[0]
    # backward ran the blocks' linear layers again (selective keeps their outputs, but the
    # recomputed forward still calls each module)
    assert linear_calls["checkpointed"] > linear_calls["plain"]
    grads = dict(checkpointed.named_parameters())
    for name, param in plain.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(grads[name].grad, param.grad, msg=name)
