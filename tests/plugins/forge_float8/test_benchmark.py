"""benchmarks/bench_float8_gpu.py without a GPU: it says so, exits with 2 and records nothing;
--smoke-cpu runs its code on the CPU without recording."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from .conftest import REPO

SCRIPT = REPO / "benchmarks" / "bench_float8_gpu.py"
RECORD = REPO / "benchmarks" / "results" / "float8_gpu.json"


def bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env, check=False
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the benchmark would run")
def test_without_cuda_the_benchmark_skips_with_a_message_and_records_nothing():
    before = RECORD.read_bytes() if RECORD.exists() else None

    done = bench()

    assert done.returncode == 2
    assert done.stderr.startswith("bench_float8_gpu.py: skipped: CUDA is not available")
    assert "use --smoke-cpu to check the script on the CPU" in done.stderr
    assert (RECORD.read_bytes() if RECORD.exists() else None) == before


def test_the_smoke_run_trains_both_sides_on_the_cpu_and_records_nothing():
    before = RECORD.read_bytes() if RECORD.exists() else None

    done = bench("--smoke-cpu")

    assert done.returncode == 0, done.stderr[-3000:]
    assert "  bf16 " in done.stdout
    assert "  float8 tensorwise " in done.stdout
    assert done.stdout.rstrip().endswith("not recorded (--smoke-cpu)")
    assert (RECORD.read_bytes() if RECORD.exists() else None) == before
