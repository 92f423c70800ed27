"""Forge plugin module of forge-optim-muon (entry point group ``forge_lm``): the ``muon`` optimizer.

Kept free of heavy imports: Forge imports this module to list plugins and validate configs.
Its options (:mod:`forge_optim_muon.options`) are imported when a config selects the optimizer;
the optimizer itself (:mod:`forge_optim_muon.optimizer`) and the factory that splits a model
into Muon and AdamW parameters (:mod:`forge_optim_muon.factory`) only when a run builds it.
"""

from __future__ import annotations

from forge_lm import hookimpl

FORGE_LM_PLUGIN_API = ">=1.2,<2"  # 1.2: options classes named by import path


@hookimpl
def forge_lm_register_optimizers(register):
    register(
        "muon",
        "forge_optim_muon.factory:build_muon",
        config="forge_optim_muon.options:MuonOptions",
        description="Muon (orthogonalised momentum) on hidden matrices, AdamW on embeddings, head, norms, biases",
    )
