"""What ``[train] cpu_linear_kernel = "auto"`` means on this host: the faster kernel, measured.

oneDNN's fp32 GEMM ran twice as fast as MKL's sgemm (behind ``torch.mm``) on one AMD EPYC, and
slower than it on an Intel Xeon with AMX: which kernel is faster is a property of the host, not
of the torch build. So ``auto`` times both on the model's own linear products (forward and
backward of each distinct shape, at the run's tokens per micro-batch), alternating the two,
and takes oneDNN only where it was at least :data:`MARGIN` faster; otherwise torch's own
kernel, which is bitwise a plain PyTorch model's.

The choice is cached on disk per host (:func:`forge_lm.hardware.host_key`: CPU model, matrix
instruction flags, thread count, torch version) and shapes, beside the measured matmul peak
(:mod:`forge_lm.metrics.measured_peak`), and only when the machine was idle: a choice made
under load serves this process alone. A process measures at
most once per model (the in and out features of its products): every later run of that model
in it reuses the choice whatever its batch, so runs in one process take the same kernel (a
gradient-accumulation run and its one-big-batch twin must round alike).
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch

from forge_lm import hardware
from forge_lm.safe_write import write_atomically

MARGIN = 1.10
"""oneDNN must be this much faster (time ratio) to be chosen: a near tie keeps torch's kernel,
so that noise cannot flip the choice between runs."""

ROUNDS = 5  # timed rounds per kernel, alternating, after one warm-up round


@attrs.frozen
class Choice:
    onednn: bool
    reason: str  # for the start event and forge doctor


# the products' (in, out) features -> Choice, for the rest of this process
_MADE: dict[tuple[tuple[int, int], ...], Choice] = {}


def choose(
    shapes: Sequence[tuple[int, int, int]], timer: Callable[[str, tuple[int, int, int]], float] | None = None
) -> Choice:
    """Whether oneDNN should take the fp32 products of ``shapes`` (``(tokens, in_features,
    out_features)``), and why: the cached choice for this host, or one measured now."""
    key_shapes = tuple(sorted(set(shapes)))
    model_key = tuple(sorted({(features_in, features_out) for _, features_in, features_out in key_shapes}))
    if model_key in _MADE:
        return _MADE[model_key]
    known = cached(key_shapes)
    if known is not None:
        _MADE[model_key] = known
        return known
    key, path = _cache_key(key_shapes), cache_path()
    others, cpus = hardware.machine_load()  # before measuring: the measurement loads the machine itself
    onednn_s, aten_s = measure(key_shapes, timer or _time_product)
    entry = {"onednn": aten_s / onednn_s >= MARGIN, "onednn_s": onednn_s, "aten_s": aten_s}
    if hardware.is_busy(others, cpus):
        choice = Choice(entry["onednn"], f"{_verdict(entry)}, measured while busy (load {others:.1f}), not cached")
    else:
        entry["date"] = datetime.date.today().isoformat()
        cache = _read(path)
        cache[key] = entry
        _write(path, cache)
        choice = Choice(entry["onednn"], f"{_verdict(entry)}, measured now")
    _MADE[model_key] = choice
    return choice


def cached(shapes: Sequence[tuple[int, int, int]]) -> Choice | None:
    """The choice cached for ``shapes`` on this host (CPU model, flags, threads, torch), or None
    where none was measured yet (then the first fp32 CPU run measures it). Measures nothing:
    ``forge doctor`` reports it."""
    entry = _read(cache_path()).get(_cache_key(tuple(sorted(set(shapes)))))
    if not _valid(entry):
        return None
    return Choice(entry["onednn"], f"{_verdict(entry)}, cached {entry['date']}")


def _cache_key(key_shapes: tuple[tuple[int, int, int], ...]) -> str:
    return f"{hardware.host_key()} | {key_shapes}"


def measure(
    shapes: Sequence[tuple[int, int, int]], timer: Callable[[str, tuple[int, int, int]], float]
) -> tuple[float, float]:
    """``(oneDNN seconds, aten seconds)``: for each kernel the sum over ``shapes`` of the best of
    :data:`ROUNDS` timings, the two kernels alternating round by round after a warm-up."""
    best = {"onednn": [float("inf")] * len(shapes), "aten": [float("inf")] * len(shapes)}
    for round_index in range(ROUNDS + 1):
        for name in ("onednn", "aten") if round_index % 2 else ("aten", "onednn"):
            for i, shape in enumerate(shapes):
                seconds = timer(name, shape)
                if round_index:  # the first round warms up thread pools and kernel selection
                    best[name][i] = min(best[name][i], seconds)
    return sum(best["onednn"]), sum(best["aten"])


def _time_product(name: str, shape: tuple[int, int, int]) -> float:
    """Seconds of one forward and backward of a ``Linear(in, out)`` on ``tokens`` rows under kernel ``name``."""
    from forge_lm.model.linear import Linear, kernel

    tokens, fan_in, fan_out = shape
    generator = torch.Generator().manual_seed(0)
    layer = Linear(fan_in, fan_out, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(fan_out, fan_in, generator=generator) * 0.02)
    x = torch.randn(tokens, fan_in, generator=generator, requires_grad=True)
    grad = torch.randn(tokens, fan_out, generator=generator)
    with kernel(name):
        start = time.perf_counter()
        layer(x).backward(grad)
        return time.perf_counter() - start


def linear_shapes(model: torch.nn.Module, tokens: int) -> list[tuple[int, int, int]]:
    """The ``(tokens, in, out)`` of every fp32 linear layer of ``model`` (Forge's and torch's)."""
    return [
        (tokens, module.in_features, module.out_features)
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32
    ]


def _verdict(entry: dict) -> str:
    ratio = entry["aten_s"] / entry["onednn_s"] if entry["onednn_s"] > 0 else 0.0
    chosen = "oneDNN" if entry["onednn"] else "torch's (aten)"
    return f"{chosen}: oneDNN measured {ratio:.2f}x torch's speed on the model's products (needs {MARGIN:.2f}x)"


def cache_path() -> Path:
    return hardware.cache_dir() / "linear_kernel.json"


def _valid(entry: object) -> bool:
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("onednn"), bool)
        or not isinstance(entry.get("date"), str)
    ):
        return False
    return all(isinstance(entry.get(k), int | float) and entry[k] > 0 for k in ("onednn_s", "aten_s"))


def _read(path: Path) -> dict:
    """The cache, or nothing when it is missing, unreadable or not a JSON object (any file there is untrusted)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, cache: dict) -> None:
    """Write the cache whole, never through a link (:mod:`forge_lm.safe_write`; not flushed to the
    disk: a lost cache costs a timing); a cache that cannot be written is skipped (the choice
    still stands)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(cache, indent=1, sort_keys=True), durable=False)
    except OSError:
        pass
