"""Metrics as one line per step on standard output."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from forge_lm.components import MetricsContext


class ConsoleBackend:
    def __init__(self, digits: int) -> None:
        self.digits = digits

    def _format(self, value: float) -> str:
        if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer()):
            return str(int(value))
        return f"{value:.{self.digits}g}"

    def start(self, config: Mapping[str, Any], manifest: Sequence[Mapping[str, str]]) -> None:
        plugins = ", ".join(f"{p['name']} ({p['distribution']} {p['version']})" for p in manifest)
        print(f"plugins: {plugins}", file=sys.stdout, flush=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        parts = [f"step {step}"] + [f"{key} {self._format(value)}" for key, value in metrics.items()]
        print(" | ".join(parts), file=sys.stdout, flush=True)

    def finish(self, summary: Mapping[str, float]) -> None:
        if summary:
            print("summary: " + " | ".join(f"{k} {self._format(v)}" for k, v in summary.items()), flush=True)


def build_console(options, context: MetricsContext) -> ConsoleBackend:
    return ConsoleBackend(options.digits)
