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

from forge_lm.train import cpu_memory, loop

# Four 8 MiB tensors written and freed, six times, counting the process's minor page faults per
# round: first with glibc's mmap threshold held at its starting value (128 KiB: every tensor is a
# mapping of its own, given back when freed and faulted in again on every round; glibc's
# adaptive default does that or not depending on what else sits on the heap), then after
# keep_freed_memory().
CHURN = textwrap.dedent(
    """
    import ctypes, json, resource, sys
    import torch
    from forge_lm.train.cpu_memory import M_MMAP_THRESHOLD, keep_freed_memory

    def faults_per_round():
        counts = []
        for _ in range(6):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            tensors = [torch.empty(2 * 1024 * 1024).fill_(1.0) for _ in range(4)]
            del tensors
            counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return counts[2:]  # the first rounds fault the memory in either way (the heap settling)

    assert ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1
    default = faults_per_round()
    done = keep_freed_memory()
    kept = faults_per_round()
    print(json.dumps({"default": default, "done": done, "kept": kept}))
    """
)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc is what the setting tunes")
def test_kept_memory_is_not_faulted_in_again_on_every_step():
    result = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, timeout=120, check=True)
    counts = json.loads(result.stdout)
    assert counts["done"] == "kept (glibc malloc thresholds raised)"
    pages = 4 * 8 * 1024 * 1024 // 4096
    assert min(counts["default"]) > pages // 2, counts  # each round faults its pages in again
    assert max(counts["kept"]) < pages // 50, counts  # kept: the freed memory is reused


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
    assert cpu_memory.keep_freed_memory() == "kept (glibc malloc thresholds raised)"
    assert libc.calls == [(-3, 32 * 1024 * 1024), (-1, 2**31 - 1)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD


def test_other_c_libraries_and_refusals_change_nothing(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert cpu_memory.keep_freed_memory() == "not changed: the C library is unknown, not glibc"
    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(cpu_memory, "_libc", lambda: object())
    assert cpu_memory.keep_freed_memory() == "not changed: this C library has no mallopt"
    monkeypatch.setattr(cpu_memory, "_libc", lambda: FakeLibc(0))
    assert cpu_memory.keep_freed_memory() == "not changed: mallopt rejected the thresholds"


def test_the_run_keeps_memory_only_on_cpu_and_when_asked(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(loop, "keep_freed_memory", lambda: calls.append("kept") or "kept")
    assert loop._cpu_memory(True, torch.device("cpu")) == "kept"
    assert loop._cpu_memory(False, torch.device("cpu")) == "not changed: [train] cpu_keep_freed_memory = false"
    assert loop._cpu_memory(True, torch.device("cuda")) == "not changed: not a CPU run"
    assert calls == ["kept"]
