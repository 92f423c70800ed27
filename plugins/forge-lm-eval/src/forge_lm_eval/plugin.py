"""Forge plugin module of forge-lm-eval (entry point group ``forge_lm``).

Registers the ``lm_eval`` evaluator (options in ``[eval.lm_eval]``) and the ``forge eval``
command, which runs it on a checkpoint (``forge_lm_eval.command``). Kept free of heavy imports:
Forge imports this module to list plugins, and lm-eval (with torch, datasets and transformers
behind it) is imported only when the evaluator is built (``forge_lm_eval.evaluator``).
"""

from __future__ import annotations

from forge_lm import hookimpl

FORGE_LM_PLUGIN_API = ">=1.2,<2"  # 1.1: forge_lm_register_commands; 1.2: options named by path


@hookimpl
def forge_lm_register_evaluators(register):
    register(
        "lm_eval",
        "forge_lm_eval.evaluator:build_lm_eval",
        config="forge_lm_eval.options:LmEvalOptions",
        description="lm-evaluation-harness tasks (multiple choice, perplexity, generation) on the live model",
    )


@hookimpl
def forge_lm_register_commands(register):
    register(
        "eval",
        "forge_lm_eval.command:COMMAND",
        description="run lm-evaluation-harness tasks on a checkpoint (the forge-lm-eval plugin)",
    )
