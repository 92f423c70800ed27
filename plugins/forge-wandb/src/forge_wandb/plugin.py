"""Forge plugin module of forge-wandb (entry point group ``forge_lm``).

Registers the ``wandb`` metrics backend (options in ``[metrics.wandb]``) and keeps the W&B
run id in each checkpoint, so a resumed training continues the same W&B run. Kept free of
heavy imports: Forge imports this module to list plugins, and ``wandb`` is imported only
when a run builds the backend (``forge_wandb.backend``).
"""

from __future__ import annotations

from forge_lm import hookimpl
from forge_wandb import _runs

FORGE_LM_PLUGIN_API = ">=1.2,<2"  # 1.2: options classes named by import path


@hookimpl
def forge_lm_register_metrics_backends(register):
    register(
        "wandb",
        "forge_wandb.backend:build_wandb",
        config="forge_wandb.options:WandbOptions",
        description="Weights & Biases: metrics, config and summary on rank 0; resumes the same W&B run",
    )


@hookimpl
def forge_lm_save_state(context):
    run_id = _runs.run_id(context.run_dir)
    return None if run_id is None else {"run_id": run_id}


@hookimpl
def forge_lm_load_state(context, state):
    run_id = state.get("run_id") if isinstance(state, dict) else None
    if isinstance(run_id, str) and run_id:
        _runs.restore(context.run_dir, run_id)


@hookimpl
def forge_lm_train_end(context, status):
    _runs.ended(context.run_dir, status)
