"""benchmarks/bench_float8_gpu.py without a GPU: it says so, exits with 2 and records nothing;
--smoke runs its code on the CPU, writing its record and table only under --output."""

from __future__ import annotations

import json
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
    assert "use --smoke to check the script on the CPU" in done.stderr
    assert (RECORD.read_bytes() if RECORD.exists() else None) == before


def test_the_smoke_run_trains_each_side_in_turn_and_writes_only_under_output(tmp_path):
    before = RECORD.read_bytes() if RECORD.exists() else None

    done = bench("--smoke", "--output", str(tmp_path))

    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "float8_gpu.json").read_text())["rows"]
    assert [row["side"] for row in rows] == ["bf16", "float8 tensorwise"]
    assert rows[0]["x_bf16"] == 1.0
    for row in rows:
        assert row["tokens_per_s"] > 0
        assert row["peak_memory_gib"] is None  # measured on CUDA only
    # The same initial model and batch: float8's first loss is bf16's up to float8 rounding.
    assert rows[1]["first_step_loss"] == pytest.approx(rows[0]["first_step_loss"], rel=2e-2)
    assert "| float8 tensorwise | " in (tmp_path / "float8_gpu.md").read_text()
    assert done.stdout.rstrip().endswith("not recorded in results/ (--smoke)")
    assert (RECORD.read_bytes() if RECORD.exists() else None) == before
