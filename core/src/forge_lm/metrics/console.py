"""Metrics on standard output: a live progress display on a terminal, plain lines elsewhere.

On a terminal the run shows a rich progress bar over the run's steps, with the latest
loss, learning rate, throughput and the time left. Anywhere else (a pipe, a log file, CI, a
SLURM output file) each logged step is one line with the same facts,
``step 10/200 [0:12<3:48] | loss 3.25 | lr 0.0003``: the step of the run's total, the time
this start has run and the time left at the rate of the steps logged since this start's
first (none before a second step is logged), then the metrics. It stays readable in a log and
``forge_lm.testing``'s reader parses it. The run's first line names the plugin distributions
briefly (``plugins: forge-lm 0.1.0 (9 plugins), forge-moe 0.1.0``); the run directory's
``plugins.json`` lists every plugin. A line holds the headline metrics (loss,
lr, grad_norm, tokens_per_sec, mfu, eval/*) and the others only while they are few: an MoE
run's per-layer statistics are left to metrics.jsonl, with one note saying how many there
are. rich is imported only for the live display, so plain mode costs nothing.

Beside the loss goes its smoothed value, an exponential moving average over the logged steps
(one value every ``metrics.log_interval`` training steps, not every step) with the weight
``[metrics.console] smoothing`` (0.9 by default; 0 turns it off)::

    biased = smoothing * biased + (1 - smoothing) * loss      # biased starts at 0
    avg = biased / (1 - smoothing ** n)                       # n: losses averaged so far

The division is TensorBoard's debiasing: without it the first averages would be pulled
towards the 0 the average starts from; with it the first average is the first loss. A plain
line shows it as its own column, ``step 20 | loss 3.1 | loss_avg 3.25 | ...``, the live
display as ``loss 3.1 (avg 3.25)``. A loss that is not finite (NaN, inf) is shown but left out
of the average, which stays that of the finite losses so far. Only the console shows the
average: metrics.jsonl and the other backends get the raw loss.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from forge_lm.components import MetricsContext
from forge_lm.metrics import EVAL_LOSS, LEARNING_RATE, LOSS, MFU, TOKENS_PER_SECOND

HEADLINE = (LOSS, LEARNING_RATE, "grad_norm", TOKENS_PER_SECOND, MFU)  # and every eval/* key
LOSS_AVERAGE = "loss_avg"  # the column of the smoothed loss on plain lines
MAX_OTHER_KEYS = 4  # a plain line shows the other keys of a step only if there are at most this many


class ConsoleBackend:
    """Prints metrics; live display when ``console`` is given or standard output is a terminal.

    ``console`` is a ``rich.console.Console`` to draw on (tests pass one writing to a buffer);
    without it, the backend decides at :meth:`start` from ``sys.stdout.isatty()``.
    ``live=False`` keeps plain lines even on a terminal. ``smoothing`` is the weight of the
    loss's moving average (see the module's docstring); 0, the default here, shows none (the
    backend built from a config gets ``[metrics.console] smoothing``, 0.9 by default).
    """

    def __init__(
        self,
        digits: int,
        total_steps: int = 0,
        *,
        live: bool = True,
        console: Any = None,
        smoothing: float = 0.0,
        clock: Any = None,
    ) -> None:
        self.digits = digits
        self.total_steps = total_steps
        self.live = live
        self._console = console
        self._clock = clock if clock is not None else time.monotonic  # tests pass a fake one
        self._started: float | None = None  # when this start began (start())
        self._first_logged: tuple[int, float] | None = None  # (step, time) of this start's first line
        self._loss_average = MovingAverage(smoothing) if smoothing > 0 else None
        self._display: _LiveDisplay | None = None
        self._left_out: set[str] = set()  # keys plain lines leave out, already noted

    def format_value(self, value: float) -> str:
        if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer()):
            return str(int(value))
        return f"{value:.{self.digits}g}"

    def format_pairs(self, metrics: Mapping[str, float]) -> list[str]:
        return [f"{key} {self.format_value(value)}" for key, value in metrics.items()]

    def start(self, config: Mapping[str, Any], manifest: Sequence[Mapping[str, str]]) -> None:
        self._started = self._clock()
        plugins = plugins_line(manifest)
        if self.live and (self._console is not None or sys.stdout.isatty()):
            self._display = _LiveDisplay(self, self._console)
            self._display.console.print(f"plugins: {plugins}", highlight=False, markup=False)
            self._display.progress.start()  # after the plugins line, which stays above the display
            return
        print(f"plugins: {plugins}", file=sys.stdout, flush=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        average = None
        if self._loss_average is not None and LOSS in metrics:
            average = self._loss_average.update(metrics[LOSS])
        if self._display is not None:
            self._display.update(step, metrics, average)
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
        pairs = []
        for key, value in shown.items():
            pairs.append(f"{key} {self.format_value(value)}")
            if key == LOSS and average is not None:
                pairs.append(f"{LOSS_AVERAGE} {self.format_value(average)}")
        print(" | ".join([self._progress(step), *pairs]), file=sys.stdout, flush=True)

    def _progress(self, step: int) -> str:
        """``step 10/200 [0:12<3:48]``: the step of the total, this start's elapsed time and the
        time left (``step 10`` alone when the total is unknown)."""
        if self.total_steps <= 0:
            return f"step {step}"
        now = self._clock()
        elapsed = now - (self._started if self._started is not None else now)
        if self._first_logged is None:
            self._first_logged = (step, now)
        first_step, first_time = self._first_logged
        timing = _duration(elapsed)
        if step > first_step:  # the rate of the steps since the first line: start-up is left out
            left = (now - first_time) / (step - first_step) * max(self.total_steps - step, 0)
            timing += f"<{_duration(left)}"
        return f"step {step}/{self.total_steps} [{timing}]"

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


def plugins_line(manifest: Sequence[Mapping[str, str]]) -> str:
    """The plugins as one short line: each distribution once, with its version and how many
    plugins it holds when more than one (the core's built-ins); plugins.json names each."""
    counts: dict[str, int] = {}
    for plugin in manifest:
        key = f"{plugin['distribution']} {plugin['version']}"
        counts[key] = counts.get(key, 0) + 1
    shown = [key if count == 1 else f"{key} ({count} plugins)" for key, count in counts.items()]
    return ", ".join(shown)


def _duration(seconds: float) -> str:
    """``0:12``, ``3:48``, ``1:02:03``: as tqdm and rich show times."""
    total = int(max(seconds, 0.0))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class MovingAverage:
    """An exponential moving average with weight ``smoothing`` in [0, 1), debiased as
    TensorBoard's smoothing is, so that it does not start near 0. Values that are not finite
    are left out."""

    def __init__(self, smoothing: float) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be at least 0 and below 1, got {smoothing!r}")
        self.smoothing = smoothing
        self._biased = 0.0
        self._count = 0

    def update(self, value: float) -> float | None:
        """Fold ``value`` in; return the average so far (None while no finite value came)."""
        if isinstance(value, int | float) and math.isfinite(value):
            self._biased = self.smoothing * self._biased + (1.0 - self.smoothing) * value
            self._count += 1
        return self.value

    @property
    def value(self) -> float | None:
        if self._count == 0:
            return None
        return self._biased / (1.0 - self.smoothing**self._count)


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
        loss 3.2 (avg 3.35) | lr 0.0003 | 51,200 tok/s | mfu 38.5%

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
        self._average: float | None = None  # the smoothed loss, None when off or not yet known

    def update(self, step: int, metrics: Mapping[str, float], average: float | None = None) -> None:
        # The values line shows the latest value of each key, so an evaluation (which logs only
        # eval/* keys) adds its loss without wiping the training loss and throughput.
        self._latest.update(metrics)
        if LOSS in metrics:
            self._average = average
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
            average = f" (avg {fmt(self._average)})" if self._average is not None else ""
            parts.append(f"loss {fmt(metrics[LOSS])}{average}")
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
    return ConsoleBackend(options.digits, context.total_steps, smoothing=options.smoothing)
