"""Forge plugin module of forge-wandb (entry point group ``forge_lm``).

Kept free of heavy imports: Forge imports this module to list plugins. The components arrive
with this package's feature work; until then the plugin is installable and listed, and
registers nothing.
"""

FORGE_LM_PLUGIN_API = ">=1,<2"
