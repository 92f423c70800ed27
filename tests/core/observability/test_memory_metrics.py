"""The memory/... metrics: the process's resident set on CPU, the caching allocator on CUDA."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest
import torch

from forge_lm.metrics import memory as memory_module
from forge_lm.metrics.memory import GIB, MemoryMetrics


def vm_rss_gib() -> float:
    """The resident set as the kernel's status file reports it: a reference independent of statm."""
    kib = re.search(r"^VmRSS:\s+(\d+) kB$", Path("/proc/self/status").read_text(), flags=re.MULTILINE).group(1)
    return int(kib) / 1024**2


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")
def test_cpu_rss_matches_the_kernels_count_and_follows_an_allocation():
    metrics = MemoryMetrics(torch.device("cpu"))
    before = metrics.read()["memory/rss_gib"]
    assert before == pytest.approx(vm_rss_gib(), abs=0.01)
    # 256 MiB of pages new to the process, written so they are resident: a mapping of its own, since
    # a tensor's memory may come from heap pages the process already holds (Forge's CPU runs keep
    # freed memory, forge_lm.train.cpu_memory, and earlier tests in this process ran some).
    ballast, page = mmap.mmap(-1, 256 * 1024**2), b"\1" * mmap.PAGESIZE
    for offset in range(0, len(ballast), len(page)):  # page by page: no 256 MiB buffer to write from
        ballast[offset : offset + len(page)] = page
    after = metrics.read()["memory/rss_gib"]
    assert after == pytest.approx(vm_rss_gib(), abs=0.01)
    assert after - before == pytest.approx(0.25, abs=0.03)
    ballast.close()


def test_without_proc_the_peak_resident_set_is_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(memory_module, "_STATM", tmp_path / "absent")
    ((name, value),) = MemoryMetrics(torch.device("cpu")).read().items()
    assert name == "memory/peak_rss_gib"
    assert value >= vm_rss_gib() - 0.01 if Path("/proc/self/status").exists() else value > 0


def test_cuda_metrics_come_from_the_allocator_and_the_peak_resets_at_each_read(monkeypatch):
    """torch.cuda mocked: the allocator's counters as memory_stats() returns them."""
    stats = {
        "allocated_bytes.all.current": 3 * GIB,
        "reserved_bytes.all.current": 5 * GIB,
        "allocated_bytes.all.peak": 4.5 * GIB,
        "num_alloc_retries": 2,
    }
    calls = []
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: calls.append(("stats", device)) or dict(stats))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append(("reset", device)))
    device = torch.device("cuda", 1)
    assert MemoryMetrics(device).read() == {
        "memory/allocated_gib": 3.0,
        "memory/reserved_gib": 5.0,
        "memory/peak_gib": 4.5,
        "memory/alloc_retries": 2.0,
    }
    assert calls == [("stats", device), ("reset", device)]  # read first, then reset: no spike is lost


def test_an_allocator_without_counters_yet_reads_zero(monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {})  # nothing allocated yet
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    assert set(MemoryMetrics(torch.device("cuda")).read().values()) == {0.0}
