"""Metrics on standard output: a live progress display on a terminal, plain lines elsewhere.

On a terminal the run shows a rich progress bar over the run's steps, with the latest
loss, learning rate, throughput and the time left. Anywhere else (a pipe, a log file, CI)
each logged step is one line, ``step 10 | loss 3.25 | lr 0.0003``, which stays readable in
a log and which ``forge_lm.testing``'s reader parses. A line holds the headline metrics (loss,
lr, grad_norm, tokens_per_sec, mfu, eval/*) and the others only while they are few: an MoE
run's per-layer statistics are left to metrics.jsonl, with one note saying how many there
are. rich is imported only for the live display, so plain mode costs nothing.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from forge_lm.components import MetricsContext
from forge_lm.metrics import EVAL_LOSS, LEARNING_RATE, LOSS, MFU, TOKENS_PER_SECOND

HEADLINE = (LOSS, LEARNING_RATE, "grad_norm", TOKENS_PER_SECOND, MFU)  # and every eval/* key
MAX_OTHER_KEYS = 4  # a plain line shows the other keys of a step only if there are at most this many


class ConsoleBackend:
    """Prints metrics; live display when ``console`` is given or standard output is a terminal.

    ``console`` is a ``rich.console.Console`` to draw on (tests pass one writing to a buffer);
    without it, the backend decides at :meth:`start` from ``sys.stdout.isatty()``.
    ``live=False`` keeps plain lines even on a terminal.
    """

    def __init__(self, digits: int, total_steps: int = 0, *, live: bool = True, console: Any = None) -> None:
        self.digits = digits
        self.total_steps = total_steps
        self.live = live
        self._console = console
        self._display: _LiveDisplay | None = None
        self._left_out: set[str] = set()  # keys plain lines leave out, already noted

    def format_value(self, value: float) -> str:
        if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer()):
            return str(int(value))
        return f"{value:.{self.digits}g}"

    def format_pairs(self, metrics: Mapping[str, float]) -> list[str]:
        return [f"{key} {self.format_value(value)}" for key, value in metrics.items()]

    def start(self, config: Mapping[str, Any], manifest: Sequence[Mapping[str, str]]) -> None:
        plugins = ", ".join(f"{p['name']} ({p['distribution']} {p['version']})" for p in manifest)
        if self.live and (self._console is not None or sys.stdout.isatty()):
            self._display = _LiveDisplay(self, self._console)
            self._display.console.print(f"plugins: {plugins}", highlight=False, markup=False)
            self._display.progress.start()  # after the plugins line, which stays above the display
            return
        print(f"plugins: {plugins}", file=sys.stdout, flush=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._display is not None:
            self._display.update(step, metrics)
            return
        shown, left_out = _plain_selection(metrics)
        if not left_out <= self._left_out:  # once per new set of keys, not on every line
            self._left_out |= left_out
            names = sorted(left_out)
            examples = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            print(
                f"note: {len(left_out)} more metrics per step ({examples}) are not shown on these lines; "
                "the jsonl backend (on by default) writes every metric to metrics.jsonl",
                file=sys.stdout,
                flush=True,
            )
        print(" | ".join([f"step {step}", *self.format_pairs(shown)]), file=sys.stdout, flush=True)

    def finish(self, summary: Mapping[str, float]) -> None:
        line = "summary: " + " | ".join(self.format_pairs(summary)) if summary else None
        if self._display is not None:
            self._display.stop()
            if line:
                self._display.console.print(line, highlight=False, markup=False)
            self._display = None
            return
        if line:
            print(line, file=sys.stdout, flush=True)


def _plain_selection(metrics: Mapping[str, float]) -> tuple[dict[str, float], set[str]]:
    """What a plain line shows, in logged order, and the keys it leaves out: the headline keys
    always, the others too when there are at most MAX_OTHER_KEYS of them."""
    others = [key for key in metrics if key not in HEADLINE and not key.startswith("eval/")]
    if len(others) <= MAX_OTHER_KEYS:
        return dict(metrics), set()
    return {key: value for key, value in metrics.items() if key not in others}, set(others)


class _LiveDisplay:
    """A rich progress display of two lines, the bar and the latest values::

        step 120/1000 ━━━━━╸────────────  12% eta 0:04:10
        loss 3.2 | lr 0.0003 | 51,200 tok/s | mfu 38.5%

    The values get a line of their own so that a narrow terminal crops them, never the step
    count or the ETA.
    """

    def __init__(self, backend: ConsoleBackend, console: Any) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TaskProgressColumn, TextColumn, TimeRemainingColumn

        self.backend = backend
        self.console = console if console is not None else Console()
        self.progress = _two_line_progress_class()(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
        )
        total = backend.total_steps or None  # None: an unknown length, drawn as a pulsing bar
        self._task = self.progress.add_task("train", total=total, stats="waiting for the first step")
        self._latest: dict[str, float] = {}

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        # The values line shows the latest value of each key, so an evaluation (which logs only
        # eval/* keys) adds its loss without wiping the training loss and throughput.
        self._latest.update(metrics)
        # rich's speed (hence the ETA) ignores the amount of the first update, so a resumed run
        # jumping from 0 to its late first step does not look fast. Refresh on every logged
        # step, not only on rich's timer, so that each one is drawn.
        self.progress.update(self._task, completed=step, stats=self._stats(self._latest), refresh=True)
        if any(key.startswith("eval") for key in metrics):
            # Evaluations are rare and worth keeping in the scrollback, above the display.
            line = " | ".join([f"step {step}", *self.backend.format_pairs(metrics)])
            self.progress.console.print(line, highlight=False, markup=False)

    def _stats(self, metrics: Mapping[str, float]) -> str:
        fmt = self.backend.format_value
        parts = []
        if LOSS in metrics:
            parts.append(f"loss {fmt(metrics[LOSS])}")
        if EVAL_LOSS in metrics:
            parts.append(f"eval {fmt(metrics[EVAL_LOSS])}")
        if LEARNING_RATE in metrics:
            parts.append(f"lr {fmt(metrics[LEARNING_RATE])}")
        throughput = metrics.get(TOKENS_PER_SECOND)
        if throughput is not None:
            parts.append(f"{throughput:,.0f} tok/s" if math.isfinite(throughput) else f"{throughput} tok/s")
        mfu = metrics.get(MFU)
        if mfu is not None:
            parts.append(f"mfu {mfu:.1%}" if math.isfinite(mfu) else f"mfu {mfu}")
        return " | ".join(parts)

    def stop(self) -> None:
        self.progress.stop()


def _two_line_progress_class() -> type:
    """A rich Progress drawing each task's ``stats`` field on a line below its bar."""
    from rich.progress import Progress
    from rich.text import Text

    class TwoLineProgress(Progress):
        def get_renderables(self):  # rich's documented hook for a custom layout
            yield self.make_tasks_table(self.tasks)
            for task in self.tasks:
                yield Text(task.fields.get("stats", ""), no_wrap=True, overflow="ellipsis")

    return TwoLineProgress


def build_console(options, context: MetricsContext) -> ConsoleBackend:
    return ConsoleBackend(options.digits, context.total_steps)
