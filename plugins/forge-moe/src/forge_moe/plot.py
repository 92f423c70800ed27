"""forge-moe's panels in ``forge plot``: routing health per MoE layer.

The MoE layers log ``moe/layer<i>/load_max``, ``load_min`` (an expert's assignments over the
uniform share: 1.0 everywhere is a perfect balance), ``load_cv`` (std / mean of the
assignments per expert: 0 is a perfect balance) and ``drop_fraction`` (assignments the
capacity limit dropped). Two panels draw them, one line per layer and statistic: "MoE load
balance" (max, min and cv) and "MoE drop fraction". Torch- and matplotlib-free: the plugin's
entry module calls it.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from forge_lm.api import PlotPanel

LAYER_KEY = re.compile(r"moe/layer(\d+)/(load_max|load_min|load_cv|drop_fraction)")
BALANCE = ("load_max", "load_min", "load_cv")  # drawn in this order within a layer
BALANCE_TITLE = "MoE load balance (per layer: max, min over the uniform share; cv)"
DROPS_TITLE = "MoE drop fraction (per layer)"


def moe_panels(keys: Collection[str]) -> list[PlotPanel]:
    """The panels for the MoE statistics among ``keys``; none when the runs logged none."""
    found: dict[str, dict[int, str]] = {}  # statistic -> layer -> key
    for key in keys:
        match = LAYER_KEY.fullmatch(key)
        if match is not None:
            found.setdefault(match.group(2), {})[int(match.group(1))] = key
    layers = sorted({layer for by_layer in found.values() for layer in by_layer})
    panels = []
    balance = [
        (found[stat][layer], f"layer {layer} {stat.removeprefix('load_')}")
        for layer in layers
        for stat in BALANCE
        if layer in found.get(stat, {})
    ]
    if balance:
        panels.append(PlotPanel(BALANCE_TITLE, balance))
    drops = found.get("drop_fraction", {})
    if drops:
        panels.append(PlotPanel(DROPS_TITLE, [(drops[layer], f"layer {layer}") for layer in sorted(drops)]))
    return panels
