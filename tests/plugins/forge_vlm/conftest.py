"""Shared by the forge-vlm tests: a plugin manager with forge-vlm only, tiny Hugging Face vision
configs (the independent reference), and one torch thread for the tiny models."""

from __future__ import annotations

from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The models here are tiny: one thread computes them as fast as two. Restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def vlm_manager():
    """The built-ins and forge-vlm only, whatever else is installed."""
    from forge_lm.plugins import PluginManager, PluginSettings

    return PluginManager(PluginSettings(allow=("vlm",)))


def _tiny_vision(config_class: Any, layer_norm_eps: float, hidden_act: str, fields: dict[str, Any]) -> Any:
    """A tiny vision config of ``config_class``: 16 x 16 images of 4 x 4 patches, width 32, 2
    blocks, eager attention; ``fields`` override."""
    defaults = {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": 16,
        "patch_size": 4,
        "layer_norm_eps": layer_norm_eps,
        "hidden_act": hidden_act,
    }
    config = config_class(**{**defaults, **fields})
    config._attn_implementation = "eager"
    return config


def tiny_clip_vision(**fields: Any) -> Any:
    """A tiny ``CLIPVisionConfig`` (CLIP's eps and quick_gelu)."""
    from transformers import CLIPVisionConfig

    return _tiny_vision(CLIPVisionConfig, 1e-5, "quick_gelu", fields)


def tiny_siglip_vision(**fields: Any) -> Any:
    """A tiny ``SiglipVisionConfig`` (SigLIP's eps and tanh GELU)."""
    from transformers import SiglipVisionConfig

    return _tiny_vision(SiglipVisionConfig, 1e-6, "gelu_pytorch_tanh", fields)


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter of ``model`` drawn at random (norm scales and biases too), so a weight
    mapped to the wrong place cannot go unnoticed."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


DEBUG_STEPS = 12


@pytest.fixture(scope="session")
def debug_run(tmp_path_factory):
    """``forge train configs/vlm_debug.toml`` for 12 steps from the CLI, metrics at every step:
    ``(run directory, the finished process)``. Shared by the training and generation tests."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    config = Path(__file__).resolve().parents[3] / "configs" / "vlm_debug.toml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_LM_")}
    env["OMP_NUM_THREADS"] = "1"
    run = tmp_path_factory.mktemp("vlm_debug") / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "forge_lm",
            "train",
            str(config),
            f"--train.output_dir={run}",
            f"--train.max_steps={DEBUG_STEPS}",
            "--metrics.log_interval=1",
            '--metrics.backends=["jsonl"]',
            "--metrics.peak_flops=1e12",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    return run, result


@pytest.fixture(scope="session")
def trained_debug_run(debug_run):
    """The directory of :func:`debug_run`, which must have trained."""
    run, result = debug_run
    assert result.returncode == 0, result.stderr[-3000:]
    return run
