"""Freed memory kept in the process on CPU (``[train] cpu_keep_freed_memory``): page faults
counted in a fresh process before and after, and each way the setting can be refused."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

from forge_lm.train import cpu_memory, parts

# Tensors written and freed, eight rounds, counting the process's minor page faults per round:
# first with glibc's mmap threshold held at its starting value (128 KiB: every tensor is a
# mapping of its own, given back when freed and faulted in again on every round; glibc's
# adaptive default does that or not depending on what else sits on the heap), then after
# keep_freed_memory(). Four 8 MiB tensors, and two of 40 MiB: above the 32 MiB that glibc's
# mmap threshold can be raised to, so only M_MMAP_MAX = 0 keeps those on the heap.
CHURN = textwrap.dedent(
    """
    import ctypes, json, resource, sys
    import torch
    from forge_lm.train.cpu_memory import M_MMAP_THRESHOLD, keep_freed_memory

    MIB = 1024 * 1024 // 4  # fp32 elements per MiB

    def faults_per_round(mib):
        counts = []
        for _ in range(8):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            tensors = [torch.empty(size * MIB).fill_(1.0) for size in mib]
            del tensors
            counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        # The first rounds fault the memory in either way: the heap grows until it holds a round's
        # blocks (for the 40 MiB ones that took three rounds in one CI run), then it is reused.
        return counts[4:]

    sizes = {"small": [8] * 4, "large": [40] * 2}
    assert ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1
    default = {name: faults_per_round(mib) for name, mib in sizes.items()}
    done = keep_freed_memory()
    kept = {name: faults_per_round(mib) for name, mib in sizes.items()}
    print(json.dumps({"default": default, "done": done, "kept": kept}))
    """
)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc is what the setting tunes")
def test_kept_memory_is_not_faulted_in_again_on_every_step():
    result = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, timeout=120, check=True)
    counts = json.loads(result.stdout)
    assert counts["done"] == cpu_memory.KEPT == "kept (glibc malloc: no mmap, thresholds raised)"
    for name, pages in (("small", 4 * 8 * 256), ("large", 2 * 40 * 256)):  # 256 pages of 4 KiB per MiB
        assert min(counts["default"][name]) > pages // 2, counts  # each round faults its pages in again
        assert max(counts["kept"][name]) < pages // 50, counts  # kept: the freed memory is reused


class FakeLibc:
    def __init__(self, answer: int) -> None:
        self.answer, self.calls = answer, []

        def mallopt(parameter: int, value: int) -> int:
            self.calls.append((parameter, value))
            return self.answer

        self.mallopt = mallopt


def test_the_thresholds_set_are_glibcs_mmap_and_trim(monkeypatch):
    libc = FakeLibc(1)
    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(cpu_memory, "_libc", lambda: libc)
    assert cpu_memory.keep_freed_memory() == "kept (glibc malloc: no mmap, thresholds raised)"
    # glibc's malloc.h: M_MMAP_THRESHOLD -3, M_MMAP_MAX -4, M_TRIM_THRESHOLD -1.
    assert libc.calls == [(-3, 32 * 1024 * 1024), (-4, 0), (-1, 2**31 - 1)]


def test_other_c_libraries_and_refusals_change_nothing(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert cpu_memory.keep_freed_memory() == "not changed: the C library is unknown, not glibc"
    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(cpu_memory, "_libc", lambda: object())
    assert cpu_memory.keep_freed_memory() == "not changed: this C library has no mallopt"
    monkeypatch.setattr(cpu_memory, "_libc", lambda: FakeLibc(0))
    assert cpu_memory.keep_freed_memory() == "not kept: mallopt rejected M_MMAP_THRESHOLD, M_MMAP_MAX, M_TRIM_THRESHOLD"


def test_the_run_keeps_memory_only_on_cpu_and_when_asked(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(parts, "keep_freed_memory", lambda: calls.append("kept") or "kept")
    assert parts.keep_cpu_memory(True, torch.device("cpu")) == "kept"
    assert parts.keep_cpu_memory(False, torch.device("cpu")) == "not changed: [train] cpu_keep_freed_memory = false"
    assert parts.keep_cpu_memory(True, torch.device("cuda")) == "not changed: not a CPU run"
    assert calls == ["kept"]
