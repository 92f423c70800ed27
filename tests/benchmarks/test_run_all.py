"""benchmarks/run_all.py: ``--gpu`` runs the GPU benchmark alone, none of the CPU benchmarks first."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import BENCHMARKS


@pytest.fixture
def launched(bench, monkeypatch, tmp_path):
    """``launched("--gpu")``: run_all's main with these arguments; the scripts it would have started."""
    run_all = bench("run_all")
    commands: list[list[str]] = []

    def fake_run(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(run_all.subprocess, "run", fake_run)
    monkeypatch.setattr(run_all, "write_results_md", lambda: None)  # the real RESULTS.md stays as it is
    monkeypatch.setattr(run_all, "RESULTS", tmp_path)  # no headlines to print

    def launch(*args: str) -> list[list[str]]:
        monkeypatch.setattr(sys, "argv", ["run_all.py", *args])
        assert run_all.main() == 0
        return commands

    return launch


def test_gpu_runs_only_the_gpu_benchmark(launched):
    assert launched("--gpu") == [[sys.executable, str(BENCHMARKS / "bench_gpu.py")]]


def test_gpu_quick_runs_the_gpu_benchmark_small(launched):
    assert launched("--gpu", "--quick") == [
        [sys.executable, str(BENCHMARKS / "bench_gpu.py"), "--rounds", "2", "--steps", "3", "--no-moe"]
    ]


def test_without_gpu_the_gpu_benchmark_is_not_run(launched):
    scripts = [command[1] for command in launched()]
    assert str(BENCHMARKS / "bench_train.py") in scripts
    assert str(BENCHMARKS / "bench_gpu.py") not in scripts
