"""fp16 on 2 gloo ranks: an overflow on one rank skips the step on both (the loss scale agrees)."""

from __future__ import annotations

import json
from pathlib import Path

from forge_lm.testing.distributed import torchrun

WORKER = Path(__file__).parent / "workers" / "fp16_worker.py"


def test_an_overflow_on_one_rank_skips_the_step_on_both(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = torchrun([str(WORKER), str(run_dir), str(tmp_path / "rank")], nproc=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["skipped"] for r in ranks] == [[2], [2]]  # rank 0's own gradients were finite
    assert [r["steps"] for r in ranks] == [4, 4]
    assert [r["scale"] for r in ranks] == [512.0, 512.0]  # halved once, never grown (interval 2000)
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # the replicas still hold the same weights
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    overflows = [e for e in events if e["type"] == "overflow"]
    assert [(e["rank"], e["step"], e["scale"], e["new_scale"]) for e in overflows] == [(0, 2, 1024.0, 512.0)]
