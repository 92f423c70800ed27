"""Which package to install for a well-known component that is not installed.

This is data for error messages only: the core never imports these packages nor branches on
them. Third-party plugins are found through their entry points and need no entry here. The
table lists every component of the first-party plugins (a test compares it with what they
register), so a config naming any of them while its plugin is missing or disabled says which
distribution to install or enable.
"""

from __future__ import annotations

KNOWN_PROVIDERS: dict[str, dict[str, str]] = {
    "optimizers": {"muon": "forge-optim-muon"},
    "models": {"deepseek_v3": "forge-deepseek"},
    "attentions": {"mla": "forge-deepseek"},
    "feed_forwards": {"moe": "forge-moe"},
    "routers": {"softmax_topk": "forge-moe", "sigmoid_topk": "forge-moe"},
    "model_transforms": {"expert_parallel": "forge-moe", "moe_load_sync": "forge-moe", "float8": "forge-float8"},
    "metrics_backends": {"wandb": "forge-wandb", "prometheus": "forge-prometheus"},
    "evaluators": {"lm_eval": "forge-lm-eval"},
}


# forge subcommands a first-party plugin adds (forge_lm_register_commands).
KNOWN_COMMANDS: dict[str, str] = {"eval": "forge-lm-eval"}


# Hugging Face model types (config.json's model_type) that a first-party plugin converts.
KNOWN_HF_MODEL_TYPES: dict[str, str] = {
    "mixtral": "forge-moe",
    "qwen3_moe": "forge-moe",
    "deepseek_v3": "forge-deepseek",
}


FIRST_PARTY = (
    "forge-deepseek",
    "forge-float8",
    "forge-lm-eval",
    "forge-moe",
    "forge-optim-muon",
    "forge-prometheus",
    "forge-wandb",
)


def known_provider(category: str, name: str) -> str | None:
    """The distribution that provides ``name`` in ``category``, if it is a known one."""
    return KNOWN_PROVIDERS.get(category, {}).get(name)
