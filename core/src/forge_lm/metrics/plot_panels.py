"""The panels of ``forge plot``: which metric keys each one draws, under which labels.

The core's five panels come first, always, in this order: training loss, evaluation loss
(``eval/loss`` and every named set's ``eval/<set>/loss``), learning rate, tokens/s and memory
(every ``memory/*_gib`` key). Plugins add panels after them through the
``forge_lm_plot_panels`` hook (:mod:`forge_lm.hookspecs`): a plugin returns
:class:`PlotPanel` objects for the keys it knows among those the runs logged, so the core
names no plugin's metrics. This module imports neither matplotlib nor torch: a plugin's entry
module builds its panels without either.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

import attrs

from forge_lm.metrics import EVAL_LOSS, LEARNING_RATE, LOSS, TOKENS_PER_SECOND

PLOT_PANELS_HOOK = "forge_lm_plot_panels"
MEMORY_PREFIX, MEMORY_SUFFIX = "memory/", "_gib"
# Memory kinds in the order their lines are drawn (and take line styles); others follow, sorted.
MEMORY_ORDER = ("allocated", "reserved", "peak", "rss", "peak_rss")
# A named validation set's loss: eval/<set name>/loss (set names: letters, digits, '_', '-').
EVAL_SET_LOSS = re.compile(r"eval/([A-Za-z0-9_-]+)/loss")
MAX_TITLE = 120  # characters of a plugin's panel title; longer ones are refused


def _lines(value: Any) -> tuple[tuple[str, str | None], ...]:
    """``{key: label}`` (or ``(key, label)`` pairs) as a tuple of pairs, in order."""
    pairs = value.items() if isinstance(value, Mapping) else value
    return tuple(tuple(pair) for pair in pairs)


def _check_lines(instance: Any, attribute: Any, lines: tuple) -> None:
    if not lines:
        raise ValueError("a panel draws at least one metric key")
    for pair in lines:
        if len(pair) != 2 or not isinstance(pair[0], str) or not (pair[1] is None or isinstance(pair[1], str)):
            raise ValueError(f"each line is (metric key, label or None), not {pair!r}")


def _check_title(instance: Any, attribute: Any, title: str) -> None:
    if not isinstance(title, str) or not title.strip() or len(title) > MAX_TITLE:
        raise ValueError(f"a panel's title is a non-empty text of at most {MAX_TITLE} characters, not {title!r}")


@attrs.frozen
class PlotPanel:
    """One panel of the figure: ``title`` and the metric keys it draws, one line per key and run.

    ``lines`` maps each metric key to its label in the legend, in drawing order (a mapping or
    ``(key, label)`` pairs). With several runs a label is prefixed with the run's name; a
    label of None means the key is the run's own line, labelled with the run's name alone
    (the training loss). ``markers`` marks every point (metrics logged at few steps, such as
    evaluations). Keys no run logged are simply not drawn; a panel with nothing drawn is
    marked "not logged".
    """

    title: str = attrs.field(validator=_check_title)
    lines: tuple[tuple[str, str | None], ...] = attrs.field(converter=_lines, validator=_check_lines)
    markers: bool = attrs.field(default=False, converter=bool)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.lines)


def is_memory_key(key: str) -> bool:
    return (
        key.startswith(MEMORY_PREFIX) and key.endswith(MEMORY_SUFFIX) and len(key) > len(MEMORY_PREFIX + MEMORY_SUFFIX)
    )


def memory_kind(key: str) -> str:
    """``memory/allocated_gib`` -> ``allocated``."""
    return key[len(MEMORY_PREFIX) : -len(MEMORY_SUFFIX)]


def is_core_key(key: str) -> bool:
    """Whether one of the core's panels draws ``key`` (in some run)."""
    return key in (LOSS, EVAL_LOSS, LEARNING_RATE, TOKENS_PER_SECOND) or is_memory_key(key) or is_eval_set_key(key)


def is_eval_set_key(key: str) -> bool:
    return EVAL_SET_LOSS.fullmatch(key) is not None


def core_panels(keys: Collection[str]) -> list[PlotPanel]:
    """The core's five panels for runs that logged ``keys``: always all five, in order."""
    sets = sorted(key for key in keys if is_eval_set_key(key))
    # The held-out split's line is the run's own when no named set shares the panel.
    evaluations = [(EVAL_LOSS, "held-out split" if sets else None)]
    evaluations += [(key, EVAL_SET_LOSS.fullmatch(key).group(1)) for key in sets]
    rank = {kind: i for i, kind in enumerate(MEMORY_ORDER)}
    memory = sorted((key for key in keys if is_memory_key(key)), key=lambda k: (rank.get(memory_kind(k), len(rank)), k))
    return [
        PlotPanel("loss", [(LOSS, None)]),
        PlotPanel("eval loss", evaluations, markers=True),  # evaluations are few points: show each
        PlotPanel("learning rate", [(LEARNING_RATE, None)]),
        PlotPanel("tokens / s", [(TOKENS_PER_SECOND, None)]),
        # A panel of no key yet ("not logged") still needs a line to name: memory/rss_gib.
        PlotPanel("memory (GiB)", [(key, memory_kind(key)) for key in memory] or [("memory/rss_gib", "rss")]),
    ]


def plugin_panels(manager: Any, keys: frozenset[str]) -> list[PlotPanel]:
    """The panels the plugins add for ``keys``, in the plugins' call order.

    A plugin's answer is untrusted: anything but a list (or tuple) of :class:`PlotPanel` is a
    :class:`~forge_lm.plugins.PluginHookFailed` naming the plugin, as is a hook that raises.
    """
    from forge_lm.plugins import PluginHookFailed

    panels: list[PlotPanel] = []
    for plugin, result in manager.call(PLOT_PANELS_HOOK, keys=keys):
        if not isinstance(result, list | tuple) or not all(isinstance(panel, PlotPanel) for panel in result):
            problem = f"returned {type(result).__name__} from {PLOT_PANELS_HOOK}; it returns a list of PlotPanel"
            raise PluginHookFailed(plugin, PLOT_PANELS_HOOK, problem)
        panels.extend(result)
    return panels
