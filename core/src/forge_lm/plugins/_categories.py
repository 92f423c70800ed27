"""The component categories. Each has one registration hook: ``forge_lm_register_<category>``."""

from __future__ import annotations

from forge_lm.errors import PluginError, did_you_mean, quoted_list

# category -> (singular, plural) nouns used in messages
CATEGORIES: dict[str, tuple[str, str]] = {
    "optimizers": ("optimizer", "optimizers"),
    "schedulers": ("scheduler", "schedulers"),
    "losses": ("loss", "losses"),
    "datasets": ("dataset", "datasets"),
    "metrics_backends": ("metrics backend", "metrics backends"),
    "tokenizers": ("tokenizer", "tokenizers"),
    "models": ("model family", "model families"),
    "attentions": ("attention layer", "attention layers"),
    "feed_forwards": ("feed-forward layer", "feed-forward layers"),
    "routers": ("router", "routers"),
    "model_transforms": ("model transform", "model transforms"),
    "evaluators": ("evaluator", "evaluators"),
}


def registration_hook(category: str) -> str:
    return f"forge_lm_register_{category}"


def check_category(category: str) -> str:
    """Return ``category`` if it exists; otherwise raise an error listing the real ones."""
    if category not in CATEGORIES:
        raise PluginError(
            f"unknown component category '{category}'.{did_you_mean(category, CATEGORIES)} "
            f"Categories: {quoted_list(CATEGORIES)}."
        )
    return category


def singular(category: str) -> str:
    return CATEGORIES[category][0]


def plural(category: str) -> str:
    return CATEGORIES[category][1]
