"""Forge plugin module of forge-deepseek (entry point ``deepseek`` in the group ``forge_lm``)."""

from __future__ import annotations

FORGE_LM_PLUGIN_API = ">=1,<2"
