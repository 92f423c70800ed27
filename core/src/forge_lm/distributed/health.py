"""The start-up health check of a distributed run: find the bad node or GPU before training on it.

One broken or slow rank makes every rank of a job wait for it, and a run that dies hours in
(or crawls at a fraction of its speed) costs far more than a few seconds of probing at start.
Right after the process group is initialised, :func:`check_health` runs on every rank:

- a timed all-reduce of a modest tensor across all ranks (warm-up iterations first, so that
  connection set-up is not timed; a barrier before each timed one, so that a rank waiting for a
  late peer does not count the wait as its own), its result checked;
- on CUDA, a timed matmul on the rank's GPU whose result is checked against checksums computed
  on the CPU, and the GPU's free memory (another process holding a GPU is a common leftover of a
  crashed job). On CPU the matmul runs too: it is cheap and finds an overloaded node.

Every rank's numbers are gathered to every rank, which then reaches the same verdict on the same
data: a rank whose probe failed (an exception, a wrong result) or that is far slower than the
others (``slow_factor`` times the other ranks' median, and more than an absolute gap, so that
the noise of tiny CPU timings never trips it) is named, with its host and device, in
:class:`HealthCheckFailed` on every rank, and ``forge train`` exits with :data:`HEALTH_EXIT_CODE`
(78). A rank whose own probe fails still takes part in every collective and reports the
failure; raising before the gather would leave the others waiting for it.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.distributed as dist

from forge_lm.errors import ForgeError

HEALTH_EXIT_CODE = 78
DEFAULT_SLOW_FACTOR = 3.0

# Absolute gaps below which a rank is never called slow, whatever the ratio: CPU timings of a
# few milliseconds on shared cores jitter by tens of them; GPU timings are steadier.
_MIN_GAP_S = {"cuda": 0.005, "cpu": 0.1}
# A rank with less free GPU memory than this share of the other ranks' median is named.
_LOW_MEMORY_SHARE = 0.5
_WARMUP, _TIMED = 2, 5
# Elements of the all-reduced tensor (float32): 32 MiB on GPUs, where bandwidth is the point;
# 1 MiB on CPU, where gloo is slow and the ranks share the cores.
_ALL_REDUCE_NUMEL = {"cuda": 8 * 2**20, "cpu": 2**18}
_MATMUL_SIZE = {"cuda": 4096, "cpu": 256}
_GIB = 1024**3


@attrs.frozen
class RankHealth:
    """What one rank measured. Times are the median of the timed iterations, in seconds; None
    where the probe failed or does not apply (free memory on CPU)."""

    rank: int
    host: str
    device: str  # "cpu", or "cuda:1 (NVIDIA H100 80GB HBM3)"
    local_rank: int = 0
    all_reduce_s: float | None = None
    all_reduce_bytes: int = 0
    matmul_s: float | None = None
    matmul_size: int = 0
    free_bytes: int | None = None
    total_bytes: int | None = None
    errors: tuple[str, ...] = ()  # probes that failed here: an exception or a wrong result

    @property
    def where(self) -> str:
        return f"rank {self.rank} (host {self.host}, {self.device})"

    def describe(self, world_size: int) -> str:
        parts = []
        if self.all_reduce_s is not None:
            # Bus bandwidth, as nccl-tests reports it: comparable across world sizes.
            bus = self.all_reduce_bytes * 2 * (world_size - 1) / world_size / max(self.all_reduce_s, 1e-12)
            parts.append(
                f"all-reduce of {_size(self.all_reduce_bytes)} {_ms(self.all_reduce_s)}"
                + (f" ({bus / 1e9:.1f} GB/s bus)" if world_size > 1 else "")
            )
        if self.matmul_s is not None:
            flops = 2 * self.matmul_size**3 / max(self.matmul_s, 1e-12)
            size = f"{self.matmul_size}x{self.matmul_size}"
            parts.append(f"matmul {size} {_ms(self.matmul_s)} ({flops / 1e12:.2f} TFLOP/s)")
        if self.free_bytes is not None and self.total_bytes is not None:
            parts.append(f"{self.free_bytes / _GIB:.1f} of {self.total_bytes / _GIB:.1f} GiB free")
        return f"{self.where}: {', '.join(parts) or 'no probe completed'}"


@attrs.frozen
class HealthReport:
    """Every rank's numbers (in rank order) and the problems found, the same on every rank."""

    ranks: tuple[RankHealth, ...]
    problems: dict[int, tuple[str, ...]] = attrs.field(factory=dict)  # rank -> what is wrong with it

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bad_ranks(self) -> list[RankHealth]:
        return [health for health in self.ranks if health.rank in self.problems]

    def describe_rank(self, health: RankHealth) -> str:
        line = health.describe(len(self.ranks))
        problems = self.problems.get(health.rank)
        return f"{line}; FAILED: {'; '.join(problems)}" if problems else f"{line}; ok"

    def describe(self) -> str:
        """One line per rank: what it measured, and ok or what failed."""
        return "\n".join(self.describe_rank(health) for health in self.ranks)

    def summary(self) -> str:
        """One line for the whole world: the median and the slowest rank of each probe, and the
        least free GPU memory (what a healthy start prints)."""
        hosts = len({health.host for health in self.ranks})
        parts = [f"{len(self.ranks)} rank(s) on {hosts} host(s)"]
        for field, what in (("all_reduce_s", "all-reduce"), ("matmul_s", "matmul")):
            timed = [(getattr(health, field), health.rank) for health in self.ranks]
            timed = [(seconds, rank) for seconds, rank in timed if seconds is not None]
            if timed:
                slowest, rank = max(timed)
                median = statistics.median(seconds for seconds, _ in timed)
                parts.append(f"{what} median {_ms(median)}, slowest {_ms(slowest)} (rank {rank})")
        free = [(health.free_bytes, health.rank) for health in self.ranks if health.free_bytes is not None]
        if free:
            least, rank = min(free)
            parts.append(f"least free GPU memory {least / _GIB:.1f} GiB (rank {rank})")
        return "; ".join(parts)


class HealthCheckFailed(ForgeError):
    """The start-up health check named ranks that failed a probe or are far slower than the rest."""

    exit_code = HEALTH_EXIT_CODE

    def __init__(self, message: str, report: HealthReport | None = None) -> None:
        super().__init__(message)
        self.report = report


def check_health(
    device: torch.device,
    *,
    slow_factor: float = DEFAULT_SLOW_FACTOR,
    min_gap_s: float | None = None,
) -> HealthReport:
    """Probe this rank, gather every rank's results and judge them all alike.

    Every rank of the default process group must call this (a single process without one
    probes itself alone). Returns the report when every rank is fit; raises
    :class:`HealthCheckFailed` naming the unfit ranks, on every rank, otherwise.
    ``min_gap_s``: how much slower than the others' median a rank must also be to be called
    slow (default: 0.1 s on CPU, 5 ms on CUDA)."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    gap = _MIN_GAP_S[kind] if min_gap_s is None else min_gap_s
    mine = _probe_this_rank(device, kind)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(gathered, attrs.asdict(mine, recurse=False))
        except Exception as exc:  # noqa: BLE001 - the group is broken: this rank can only speak for itself
            raise HealthCheckFailed(
                f"the start-up health check (resilience.health_check) could not gather the ranks' results on "
                f"{mine.where}: {type(exc).__name__}: {exc}. Another rank's process died or the network between "
                "the ranks is down: look for the first error in the other ranks' output, then run the same command."
            ) from None
        ranks = tuple(RankHealth(**{**fields, "errors": tuple(fields["errors"])}) for fields in gathered)
    else:
        ranks = (mine,)
    report = HealthReport(ranks, _verdict(ranks, slow_factor, gap))
    if not report.ok:
        raise HealthCheckFailed(_failure_message(report), report)
    return report


# -- this rank's probes -------------------------------------------------------------------------


def _probe_this_rank(device: torch.device, kind: str) -> RankHealth:
    """This rank's numbers. Every failure is caught and reported: the collectives below (and
    the gather after) must be reached by every rank, whatever went wrong on one."""
    errors: list[str] = []
    name = str(device)
    free = total = None
    matmul_s = None
    if kind == "cuda":
        try:
            name = f"{device} ({torch.cuda.get_device_name(device)})"
            free, total = (int(value) for value in torch.cuda.mem_get_info(device))
        except Exception as exc:  # noqa: BLE001 - a failing GPU raises anything; it is reported, not raised
            errors.append(f"reading the GPU's memory failed: {type(exc).__name__}: {exc}")
    try:
        matmul_s = _matmul_probe(device, _MATMUL_SIZE[kind])
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the collectives below must be reached
        errors.append(f"matmul probe failed: {type(exc).__name__}: {exc}")
    all_reduce_s, numel = None, _ALL_REDUCE_NUMEL[kind]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        try:
            all_reduce_s = _all_reduce_probe(device, numel)
        except Exception as exc:  # noqa: BLE001 - reported, not raised: the gather below must be reached
            errors.append(f"all-reduce probe failed: {type(exc).__name__}: {exc}")
    return RankHealth(
        rank=dist.get_rank() if dist.is_available() and dist.is_initialized() else 0,
        host=socket.gethostname(),
        device=name,
        local_rank=int(os.environ.get("LOCAL_RANK", "0") or 0),
        all_reduce_s=all_reduce_s,
        all_reduce_bytes=numel * 4,
        matmul_s=matmul_s,
        matmul_size=_MATMUL_SIZE[kind],
        free_bytes=free,
        total_bytes=total,
        errors=tuple(errors),
    )


def _compute_device(device: torch.device) -> torch.device:
    """Where the probes' tensors live: the rank's device. (The tests replace this to run the
    CUDA path, with torch.cuda mocked, on CPU tensors.)"""
    return device


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # CUDA calls return before the work is done: wait for it to time it
        torch.cuda.synchronize(device)


def _median_time(run: Callable[[], None], device: torch.device, warmup: int = _WARMUP, timed: int = _TIMED) -> float:
    for _ in range(warmup):
        run()
    _synchronize(device)
    times = []
    for _ in range(timed):
        start = time.perf_counter()
        run()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_probe(device: torch.device, size: int) -> float:
    """The median time of a ``size`` x ``size`` float32 matmul on ``device``; raises when the
    product is wrong. The factors hold -1, 0 and 1, so every product and partial sum is a small
    integer that float32 (and TF32, and bf16 inputs) hold exactly: the row and column sums of the
    product must equal the checksums the CPU computes in float64 (A·(B·1) and (1·A)·B) exactly."""
    generator = torch.Generator().manual_seed(1234)
    a = torch.randint(-1, 2, (size, size), generator=generator, dtype=torch.float32)
    b = torch.randint(-1, 2, (size, size), generator=generator, dtype=torch.float32)
    ones = torch.ones(size, dtype=torch.float64)
    row_sums = a.double() @ (b.double() @ ones)
    column_sums = (ones @ a.double()) @ b.double()
    where = _compute_device(device)
    a, b = a.to(where), b.to(where)
    product: list[torch.Tensor] = []

    def multiply() -> None:
        product[:] = [torch.matmul(a, b)]

    seconds = _median_time(multiply, device)
    result = product[0]
    rows_ok = torch.equal(result.sum(dim=1, dtype=torch.float64).cpu(), row_sums)
    columns_ok = torch.equal(result.sum(dim=0, dtype=torch.float64).cpu(), column_sums)
    if not (rows_ok and columns_ok):
        raise ArithmeticError(f"a {size}x{size} matmul gave a wrong result (its checksums differ from the CPU's)")
    return seconds


def _all_reduce_probe(device: torch.device, numel: int) -> float:
    """The median time of a sum all-reduce of ``numel`` float32 across all ranks; raises when
    the sum is wrong. A barrier (not timed) precedes each one: a rank that arrives late then
    does not make the others' times long, and its own slowness stays its own."""
    world, rank = dist.get_world_size(), dist.get_rank()
    expected = world * (world + 1) / 2  # each rank contributes rank + 1
    tensor = torch.empty(numel, dtype=torch.float32, device=_compute_device(device))

    def reduce() -> None:
        tensor.fill_(rank + 1)
        dist.all_reduce(tensor)

    for _ in range(_WARMUP):  # the first collectives set up connections (NCCL communicators)
        reduce()
    _synchronize(device)
    times = []
    for _ in range(_TIMED):
        dist.barrier()
        start = time.perf_counter()
        reduce()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    low, high = tensor.min().item(), tensor.max().item()
    if not low == high == expected:
        raise ArithmeticError(f"the all-reduce gave {low}..{high} where every element should be {expected:g}")
    return statistics.median(times)


# -- the verdict --------------------------------------------------------------------------------


def _verdict(ranks: tuple[RankHealth, ...], slow_factor: float, min_gap_s: float) -> dict[int, tuple[str, ...]]:
    """What is wrong with each rank (only ranks with problems appear). A pure function of the
    gathered numbers: every rank computes the same verdict."""
    problems: dict[int, list[str]] = {health.rank: list(health.errors) for health in ranks}
    for field, what in (("matmul_s", "the matmul"), ("all_reduce_s", "the all-reduce")):
        for health in ranks:
            value = getattr(health, field)
            # The other ranks' median: with two ranks the median of both would sit halfway to
            # the slow one, and a rank 10x slower would not even be 3x that.
            others = [getattr(other, field) for other in ranks if other is not health]
            others = [other for other in others if other is not None]
            if value is None or not others:
                continue
            reference = statistics.median(others)
            if value > slow_factor * reference and value - reference > min_gap_s:
                problems[health.rank].append(
                    f"{what} took {_ms(value)}, {value / max(reference, 1e-12):.1f}x the other ranks' median of "
                    f"{_ms(reference)}"
                )
    for health in ranks:
        if health.free_bytes is None:
            continue
        others = [other.free_bytes for other in ranks if other is not health and other.free_bytes is not None]
        if others and health.free_bytes < _LOW_MEMORY_SHARE * statistics.median(others):
            problems[health.rank].append(
                f"only {health.free_bytes / _GIB:.1f} GiB of its GPU's memory is free, against a median of "
                f"{statistics.median(others) / _GIB:.1f} GiB on the other ranks (another process holds this GPU?)"
            )
    return {rank: tuple(found) for rank, found in problems.items() if found}


def _failure_message(report: HealthReport) -> str:
    bad = report.bad_ranks
    named = "; ".join(f"{health.where}: {', '.join(report.problems[health.rank])}" for health in bad)
    hosts = sorted({health.host for health in bad})
    return (
        f"the start-up health check (resilience.health_check) found {len(bad)} of {len(report.ranks)} ranks unfit: "
        f"{named}. Run the job without {'that host' if len(hosts) == 1 else 'those hosts'} or GPU "
        f"(SLURM: --exclude={','.join(hosts)}), or check it with 'torchrun --nproc_per_node=N -m forge_lm doctor' "
        "there; set resilience.health_check = false to train anyway."
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB"
