"""Launch real multi-process runs for tests: ``torchrun`` on CPU with the gloo backend.

Used by Forge's own distributed tests and available to plugin authors::

    result = torchrun(["-m", "forge_lm", "train", "--distributed.dp_shard=2"], nproc=2)
    assert result.returncode == 0, result.stderr
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def torchrun(
    args: Sequence[str],
    nproc: int = 2,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 600.0,
) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc_per_node=nproc args...`` and wait for it.

    ``args`` is what follows torchrun's own options: a script path and its arguments, or
    ``-m module ...``. Each rank gets one intra-op thread (ranks share the machine's cores).
    Output is captured as text; the caller checks ``returncode``.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, env=full_env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def metrics_by_step(run_dir: str | Path) -> dict[int, dict[str, float]]:
    """The run's ``metrics.jsonl`` as ``{step: metrics}``, the records of one step merged and
    the newest winning: a resumed run logs a step again, and evaluations log apart from
    training. What multi-process tests compare against the one-process run."""
    from forge_lm.metrics.jsonl import read_metrics

    steps: dict[int, dict[str, float]] = {}
    for record in read_metrics(Path(run_dir) / "metrics.jsonl"):
        steps.setdefault(record["step"], {}).update(record)
    return steps
