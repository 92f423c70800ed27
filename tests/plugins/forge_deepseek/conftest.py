"""Shared by the forge-deepseek tests: tiny Hugging Face DeepSeek-V3 configs (the independent
reference), and one torch thread for the tiny models."""

from __future__ import annotations

import os
import subprocess
import sys
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


def tiny_hf_config(**fields: Any) -> Any:
    """A tiny ``DeepseekV3Config``: hidden 64, 3 layers (the first dense), 4 experts of which 2 per
    token, one shared expert, one expert group, eager attention, fp32."""
    from transformers import DeepseekV3Config

    defaults = {
        "vocab_size": 97,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_interleave": True,
        "initializer_range": 0.1,
        "num_mtp_layers": 0,
        "tie_word_embeddings": False,
    }
    config = DeepseekV3Config(**{**defaults, **fields})
    config._attn_implementation = "eager"
    return config


@pytest.fixture(scope="session")
def deepseek_manager():
    """The built-ins, forge-moe and forge-deepseek only, whatever else is installed."""
    from forge_lm.plugins import PluginManager, PluginSettings

    return PluginManager(PluginSettings(allow=("moe", "deepseek")))


def forge_cli_run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """``forge ARGS`` in a fresh interpreter, with one torch thread (tiny models) and no
    ``FORGE_LM_*`` settings from the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_LM_")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "forge_lm", *args], capture_output=True, text=True, env=env, timeout=timeout
    )
