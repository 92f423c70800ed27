"""Shared by the GPU benchmarks (``bench_gpu.py``, ``bench_float8_gpu.py``): measure sides in turn, bring results home.

A GPU session is scarce and one GPU cannot hold every side at once (the MoE model's Forge,
plain and compiled sides with their AdamW states would need about 155 GB together), so
:func:`measure_in_turn` builds one side, measures it, reads its peak memory and frees it
before building the next: only one side's model, gradients and optimizer state are ever
resident. Within a side, warm-up rounds come first, then timed rounds, each a block of
steps; the side's figure is the median of its rounds.

A side is anything with ``run(steps) -> tokens/s``; it may have ``first`` (``(loss, grad
norm)`` of its first step) and ``close()``. A side that fails (an exception, out of memory)
is recorded with its error and the others still run: a session must bring home what did work.

:func:`publish` writes a record (the shape of ``results/<name>.json``) to ``--output DIR``, as
JSON and as a Markdown table, and, for a real GPU run, into ``results/`` with ``RESULTS.md``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _record import RESULTS, median, record_markdown, write_results_md


@dataclasses.dataclass
class SideResult:
    """What one side measured: tokens/s per timed round, its peak memory, its first loss."""

    name: str
    samples: list[float] = dataclasses.field(default_factory=list)
    peak_memory_gib: float | None = None  # None on a CPU: no allocator statistics to read
    first_step_loss: float | None = None
    build_s: float = 0.0
    error: str | None = None

    @property
    def tokens_per_s(self) -> float | None:
        return median(self.samples) if self.samples else None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    """GiB the caching allocator held at most since :func:`reset_peak_memory`; None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def free_memory(device: torch.device) -> None:
    """Return a freed side's memory: collect its reference cycles, drop compiled graphs (which can
    hold on to the model they were traced from) and hand cached blocks back to the driver."""
    gc.collect()
    if "torch._dynamo" in sys.modules:  # only a run that compiled has graphs to drop
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_side(
    name: str, build: Callable[[], Any], *, rounds: int, warmup: int, steps: int, device: torch.device
) -> SideResult:
    """Build one side, run ``warmup`` then ``rounds`` blocks of ``steps`` steps, read its peak
    memory, close and free it. An exception is recorded in ``error`` (traceback on stderr)."""
    result = SideResult(name)
    reset_peak_memory(device)  # before the build: the side's weights and optimizer state count
    started = time.perf_counter()
    side = None
    try:
        side = build()
        result.build_s = time.perf_counter() - started
        for index in range(warmup + rounds):
            value = side.run(steps)
            timed = index >= warmup
            if timed:
                result.samples.append(value)
            kind = "timed" if timed else "warm-up"
            print(f"  {name}: round {index + 1}/{warmup + rounds} ({kind}) {value:10.0f} tok/s", flush=True)
        result.peak_memory_gib = peak_memory_gib(device)
        first = getattr(side, "first", None)
        result.first_step_loss = first[0] if first else None
        if callable(getattr(side, "close", None)):
            side.close()
    except Exception as exc:  # noqa: BLE001 - one failing side must not lose the others' numbers
        traceback.print_exc()
        result.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        print(f"  {name}: failed: {result.error}", file=sys.stderr, flush=True)
    finally:
        side = None  # the only reference: the side is garbage from here on
        free_memory(device)
    return result


def measure_in_turn(
    builders: dict[str, Callable[[], Any]],
    *,
    rounds: int,
    warmup: int,
    steps: int,
    device: torch.device,
    after_each: Callable[[dict[str, SideResult]], None] | None = None,
) -> dict[str, SideResult]:
    """:func:`measure_side` for each of ``builders`` in order, never two sides resident at once.

    ``after_each(results so far)`` runs after every side: a script writes its partial results
    there, so a session cut short still brings home the sides it finished."""
    results: dict[str, SideResult] = {}
    for name, build in builders.items():
        results[name] = measure_side(name, build, rounds=rounds, warmup=warmup, steps=steps, device=device)
        if after_each is not None:
            after_each(results)
    return results


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int, iterations: int) -> float:
    """FLOP/s of ``torch.mm`` of two ``size`` x ``size`` matrices, best of 3 timings of ``iterations``."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    best = float("inf")
    for _ in range(3):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(iterations):
            torch.mm(a, b)
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / iterations)
    return 2 * size**3 / best


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def refuse_without_cuda(script: str, needs: str) -> int | None:
    """Exit code 2 with a message when CUDA is missing (the caller returns it), else None."""
    if torch.cuda.is_available():
        return None
    print(
        f"{script}: skipped: CUDA is not available (torch {torch.__version__}); this benchmark needs {needs} and "
        "records nothing without it. Run it on such a machine, or use --smoke to check the script on the CPU.",
        file=sys.stderr,
    )
    return 2


# --------------------------------------------------------------------------------------
# Bringing the numbers home
# --------------------------------------------------------------------------------------


def markdown(record: dict[str, Any]) -> str:
    """The record as a short Markdown page: what ran, where, the notes and every table."""
    return "\n".join(record_markdown(record, heading="#"))


def publish(record: dict[str, Any], output: Path | None, *, save_results: bool) -> list[Path]:
    """Write ``record`` to ``output/<name>.json`` and ``output/<name>.md`` (``output`` not None),
    and to ``results/<name>.json`` with a regenerated ``RESULTS.md`` (``save_results``)."""
    written = []
    text = json.dumps(record, indent=2) + "\n"
    if output is not None:
        output.mkdir(parents=True, exist_ok=True)
        (output / f"{record['benchmark']}.json").write_text(text)
        (output / f"{record['benchmark']}.md").write_text(markdown(record))
        written += [output / f"{record['benchmark']}.json", output / f"{record['benchmark']}.md"]
    if save_results:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{record['benchmark']}.json").write_text(text)
        write_results_md()
        written.append(RESULTS / f"{record['benchmark']}.json")
    return written
