"""``[distributed] cpu_offload`` for real on 2 gloo ranks, the CPU standing in for the GPU
(tests/core/distributed/workers/offload_worker.py): FSDP2 holds the shards as offloaded, the
losses equal the run without offloading, and a run resumed from an offloaded checkpoint goes on
exactly as the uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forge_lm.testing.distributed import torchrun

WORKER = Path(__file__).parent / "workers" / "offload_worker.py"

pytestmark = pytest.mark.slow  # one launch of 2 ranks, four short runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("offload")
    out = work / "results.json"
    result = torchrun([str(WORKER), str(work), str(out)], nproc=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


def test_fsdp2_holds_the_shards_and_optimizer_state_offloaded(runs: dict) -> None:
    for seen in runs["offloaded"]["ranks"]:
        assert seen["status"] == "completed"
        assert seen["units"] == 3  # two blocks and the root
        assert seen["offloaded"] == [True]
        assert seen["shard_devices"] == ["cpu"]
        assert seen["optimizer_devices"] == ["cpu"]
    for seen in runs["plain"]["ranks"]:
        assert seen["offloaded"] == [False]


def test_offloading_moves_the_state_and_leaves_the_losses_as_they_were(runs: dict) -> None:
    offloaded, plain = runs["offloaded"]["losses"], runs["plain"]["losses"]
    assert list(offloaded) == ["1", "2", "3"]
    assert offloaded == plain  # bitwise: the same arithmetic, on shards kept elsewhere


def test_a_run_resumed_from_an_offloaded_checkpoint_goes_on_exactly(runs: dict) -> None:
    assert list(runs["first_half"]["losses"]) == ["1", "2"]
    assert runs["resumed"]["losses"] == runs["offloaded"]["losses"]
