"""Run under torchrun (gloo on CPU): the start-up health check in several scenarios, one after
the other in the same process group; each injects a fault on one rank only.

Usage: health_worker.py OUT_DIR SCENARIO...
Writes OUT_DIR/rank<R>.json: {scenario: {"ok", "message", "problems", "describe", "summary"}}.

Scenarios (the faulty rank is always rank 1):
- healthy: nothing injected.
- slow_matmul: rank 1's matmuls each take 0.3 s longer.
- slow_all_reduce: rank 1 spends 0.3 s more in each all-reduce (after the data has moved).
- failing_matmul: rank 1's matmul raises, as a GPU fault would.
- wrong_matmul: rank 1's matmul returns a product with one wrong element.
- mocked_cuda: torch.cuda mocked (the tensors stay on the CPU): every rank "has" a GPU of 80 GiB,
  rank 1's with only 5 GiB free.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from forge_lm.distributed import health
from forge_lm.distributed.health import HealthCheckFailed, check_health

DELAY_S = 0.3
GIB = 1024**3


@contextlib.contextmanager
def injected(scenario: str, rank: int) -> Iterator[torch.device]:
    """The fault of ``scenario`` on rank 1; yields the device to check."""
    real_matmul, real_all_reduce = torch.matmul, dist.all_reduce
    faulty = rank == 1

    def slow_matmul(a, b):
        time.sleep(DELAY_S)
        return real_matmul(a, b)

    def slow_all_reduce(tensor, *args, **kwargs):
        done = real_all_reduce(tensor, *args, **kwargs)
        time.sleep(DELAY_S)
        return done

    def failing_matmul(a, b):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    def wrong_matmul(a, b):
        product = real_matmul(a, b)
        product[7, 3] += 1
        return product

    patches = {
        "slow_matmul": mock.patch.object(torch, "matmul", slow_matmul),
        "slow_all_reduce": mock.patch.object(dist, "all_reduce", slow_all_reduce),
        "failing_matmul": mock.patch.object(torch, "matmul", failing_matmul),
        "wrong_matmul": mock.patch.object(torch, "matmul", wrong_matmul),
    }
    if scenario == "mocked_cuda":
        free = 5 * GIB if faulty else 79 * GIB
        with (
            mock.patch.object(health, "_compute_device", return_value=torch.device("cpu")),
            mock.patch.object(torch.cuda, "synchronize", return_value=None),
            mock.patch.object(torch.cuda, "get_device_name", return_value="NVIDIA H100 80GB HBM3"),
            mock.patch.object(torch.cuda, "mem_get_info", return_value=(free, 80 * GIB)),
            # Sizes for a CPU: the real ones (a 4096 matmul) would take seconds here.
            mock.patch.dict(health._MATMUL_SIZE, {"cuda": 128}),
            mock.patch.dict(health._ALL_REDUCE_NUMEL, {"cuda": 4096}),
        ):
            yield torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    elif faulty and scenario in patches:
        with patches[scenario]:
            yield torch.device("cpu")
    else:
        yield torch.device("cpu")


def main() -> int:
    out, scenarios = Path(sys.argv[1]), sys.argv[2:]
    # A short group timeout: a scenario that left a rank behind fails fast instead of hanging.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    results = {}
    for scenario in scenarios:
        with injected(scenario, rank) as device:
            try:
                report, message = check_health(device), ""
            except HealthCheckFailed as failure:
                report, message = failure.report, str(failure)
        results[scenario] = {
            "ok": not message,
            "message": message,
            "problems": {str(r): list(found) for r, found in report.problems.items()},
            "describe": report.describe(),
            "summary": report.summary(),
        }
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # gloo may abort in its destructors at exit; the results are written
