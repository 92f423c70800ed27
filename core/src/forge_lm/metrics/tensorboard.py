"""Metrics as TensorBoard scalars in the run directory.

Each logged metric becomes a scalar series named by its key, written through
``torch.utils.tensorboard.SummaryWriter`` into ``<run_dir>/<subdir>``; point
``tensorboard --logdir`` at the run directory (or at a folder of runs) to watch them. The
resolved config, the plugins and the final summary are stored as text. tensorboard is an
optional dependency (``pip install forge-lm[tensorboard]``), imported when the backend is built.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from forge_lm.components import MetricsContext
from forge_lm.errors import PluginError

INSTALL_HINT = "pip install forge-lm[tensorboard]"


class TensorboardBackend:
    def __init__(self, log_dir: Path, writer_class: type) -> None:
        self.log_dir = log_dir
        self._writer_class = writer_class
        self._writer = None

    def start(self, config: Mapping[str, Any], manifest: Sequence[Mapping[str, str]]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = self._writer_class(log_dir=str(self.log_dir))
        # Markdown code blocks, so TensorBoard's text tab shows the JSON with its indentation.
        self._writer.add_text("config", _code_block(json.dumps(config, indent=2, default=str)), 0)
        plugins = "\n".join(f"- {p['name']} ({p['distribution']} {p['version']})" for p in manifest)
        self._writer.add_text("plugins", plugins or "(none)", 0)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            # Tensor-style scalars in float64: the classic style keeps float32, which rounds a
            # learning rate of 1e-4 to 9.9999997e-05. NaN and Inf are stored as they are.
            self._writer.add_scalar(key, float(value), step, new_style=True, double_precision=True)
        # One flush per logged step, not per scalar: a crash then loses no logged step.
        self._writer.flush()

    def finish(self, summary: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        if summary:
            rows = "\n".join(f"| {key} | {_number(value)} |" for key, value in summary.items())
            self._writer.add_text("summary", f"| metric | value |\n| --- | --- |\n{rows}", 0)
        self._writer.close()
        self._writer = None


def _summary_writer_class() -> type:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # torch re-raises tensorboard's absence as a plain ImportError
        raise PluginError(
            f"metrics backend 'tensorboard' needs the tensorboard package, which is not installed ({exc}). "
            f"Install it with `{INSTALL_HINT}`, or remove 'tensorboard' from [metrics] backends."
        ) from None
    return SummaryWriter


def _code_block(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _number(value: float) -> str:
    return str(value) if not isinstance(value, float) or not math.isfinite(value) else f"{value:.6g}"


def read_scalars(log_dir: str | Path) -> list[tuple[int, dict[str, float]]]:
    """Every scalar under ``log_dir`` as ``(step, {key: value})``, in step order.

    Reads the event files with TensorBoard's own (plugin-aware) ``EventAccumulator``, which
    serves classic and tensor-style scalars alike, keeping every point (by default it keeps
    a sample of the points of long series).
    """
    from tensorboard.backend.event_processing import plugin_event_accumulator
    from tensorboard.util import tensor_util

    accumulator = plugin_event_accumulator.EventAccumulator(
        str(log_dir), size_guidance={plugin_event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    by_step: dict[int, dict[str, float]] = {}
    for tag in accumulator.Tags()["tensors"]:
        if accumulator.SummaryMetadata(tag).plugin_data.plugin_name != "scalars":
            continue  # the text of the config, plugins and summary
        for event in accumulator.Tensors(tag):
            by_step.setdefault(event.step, {})[tag] = float(tensor_util.make_ndarray(event.tensor_proto).item())
    return sorted(by_step.items())


def build_tensorboard(options, context: MetricsContext) -> TensorboardBackend:
    # Imported here, not at start(), so a missing tensorboard stops the run before it trains.
    return TensorboardBackend(Path(context.run_dir) / options.subdir, _summary_writer_class())
