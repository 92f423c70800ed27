"""Under FSDP2 (two gloo ranks on the CPU) Muon orthogonalises whole matrices, not shards.

Two processes shard the tiny mixture model with ``fully_shard`` and train it on half of each
batch; their parameters after three steps equal those of one process training on the whole
batches. Orthogonalising each rank's shard instead would give different updates.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge_optim_muon.factory import build_muon

WORKER = Path(__file__).resolve().parent / "_fsdp_worker.py"
STEPS = 3
OPTIONS = {"lr": 0.05, "adamw_lr": 0.01, "weight_decay": 0.1, "ns_dtype": "float32"}  # as the worker's


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("fsdp")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORGE_LM_", "TORCHELASTIC_"))}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"})
    ranks = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(out)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    for rank, process in enumerate(ranks):
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, f"rank {rank} failed:\n{stderr[-3000:]}"
        outputs.append(stdout)
    return out, outputs


def test_fsdp2_run_updates_parameters_as_the_single_process_run_does(fsdp_run, models):
    out, _ = fsdp_run
    sharded = torch.load(out / "params.pt", weights_only=True)
    model = models.tiny_mixture_lm()
    models.train(model, build_muon(models.muon_options(**OPTIONS), model), models.batches(STEPS))
    initial = models.tiny_mixture_lm().state_dict()
    for name, expected in model.named_parameters():
        assert not torch.equal(expected, initial[name]), f"{name} never moved: the comparison would prove nothing"
        torch.testing.assert_close(sharded[name], expected.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_fsdp2_ranks_share_the_orthogonalisation_of_whole_matrices(fsdp_run, models):
    out, _ = fsdp_run
    model = models.tiny_mixture_lm()
    matrices = sum(
        a.param[..., 0, 0].numel() for a in build_muon(models.muon_options(), model).assignments if a.side == "muon"
    )
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank in ranks:
        assert rank["buffers"] == ["DTensor"]  # momentum stays sharded like its parameter
    per_step = [sum(rank["orthogonalised"]) / STEPS for rank in ranks]
    # Each rank orthogonalises about half of the whole matrices (batches padded to an even count).
    assert per_step[0] == per_step[1]
    assert matrices / 2 <= per_step[0] <= matrices / 2 + 2


def test_only_rank_zero_reports_the_parameter_split(fsdp_run):
    _, outputs = fsdp_run
    assert "muon: Muon:" in outputs[0]
    assert "muon:" not in outputs[1]
