"""Under FSDP2 and HSDP (two gloo ranks on the CPU) Muon orthogonalises whole matrices, not shards,
a bounded group at a time, with the work split over every rank of the mesh.

Two processes shard the tiny mixture model with ``fully_shard``, on a 1-D mesh (FSDP2: 2 shards)
and on a 2-D one (HSDP: 2 replicas x 1 shard), and train it on half of each batch; their
parameters after three steps equal those of one process training on the whole batches.
Orthogonalising each rank's shard instead would give different updates. A second run with a
small gather budget gathers at most that many bytes at once and ends bit for bit where the
default run does.
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
SMALL_BUCKET_BYTES = int(0.02 * 2**20)  # the worker's SMALL_BUCKET_MB


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module", params=["fsdp", "hsdp"])
def fsdp_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], str]:
    layout = request.param
    out = tmp_path_factory.mktemp(layout)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORGE_LM_", "TORCHELASTIC_"))}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"})
    ranks = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(out), layout],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    for rank, process in enumerate(ranks):
        stdout, stderr = process.communicate(timeout=180)
        assert process.returncode == 0, f"rank {rank} failed:\n{stderr[-3000:]}"
        outputs.append(stdout)
    return out, outputs, layout


def _reports(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def one_process(models) -> tuple[torch.nn.Module, object]:
    """The reference: the same model and steps in one process, on the whole batches."""
    model = models.tiny_mixture_lm()
    optimizer = build_muon(models.muon_options(**OPTIONS), model)
    models.train(model, optimizer, models.batches(STEPS))
    return model, optimizer


def test_sharded_run_updates_parameters_as_the_single_process_run_does(fsdp_run, one_process, models):
    out, _, layout = fsdp_run
    assert _reports(out)[0]["default"]["mesh_ndim"] == (2 if layout == "hsdp" else 1)
    sharded = torch.load(out / "params_default.pt", weights_only=True)
    model, _ = one_process
    initial = models.tiny_mixture_lm().state_dict()
    for name, expected in model.named_parameters():
        assert not torch.equal(expected, initial[name]), f"{name} never moved: the comparison would prove nothing"
        torch.testing.assert_close(sharded[name], expected.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_ranks_share_the_orthogonalisation_of_whole_matrices(fsdp_run, one_process):
    """On the 1-D mesh and on HSDP's 2-D one alike, each rank does about half of the work."""
    out, _, _ = fsdp_run
    _, optimizer = one_process
    matrices = sum(a.param[..., 0, 0].numel() for a in optimizer.assignments if a.side == "muon")
    ranks = [report["default"] for report in _reports(out)]
    for rank in ranks:
        assert rank["buffers"] == ["DTensor"]  # momentum stays sharded like its parameter
    per_step = [sum(rank["orthogonalised"]) / STEPS for rank in ranks]
    # Each rank orthogonalises about half of the whole matrices (batches padded to an even count).
    assert per_step[0] == per_step[1]
    assert matrices / 2 <= per_step[0] <= matrices / 2 + 3  # at most one padding matrix per batch


def test_small_gather_budget_bounds_each_group_and_changes_no_bit(fsdp_run, one_process):
    out, _, _ = fsdp_run
    _, optimizer = one_process
    whole_matrices = sum(a.param.numel() * 4 for a in optimizer.assignments if a.side == "muon")  # fp32 bytes
    default = torch.load(out / "params_default.pt", weights_only=True)
    small = torch.load(out / "params_small_buckets.pt", weights_only=True)
    for name, expected in default.items():
        assert torch.equal(small[name], expected), f"{name}: a smaller gather budget changed the result"
    for report in _reports(out):
        cut, uncut = report["small_buckets"]["gathered"], report["default"]["gathered"]
        assert whole_matrices > SMALL_BUCKET_BYTES  # the budget is below the step's whole: it must cut
        assert max(cut) <= SMALL_BUCKET_BYTES
        assert max(uncut) > SMALL_BUCKET_BYTES  # the default gathers a whole batch of one shape at once
        assert len(cut) > len(uncut)
        assert sum(cut) == sum(uncut) == STEPS * whole_matrices  # every matrix gathered once per step


def test_roles_under_fsdp2_are_those_of_one_process(fsdp_run, one_process):
    out, _, _ = fsdp_run
    _, optimizer = one_process
    expected = [[a.name, a.side, a.role, a.decay] for a in optimizer.assignments]
    assert {a[2] for a in expected} >= {"hidden matrix", "stacked matrices", "output head", "router", "embedding"}
    for report in _reports(out):
        assert report["default"]["roles"] == expected


def test_only_rank_zero_reports_the_parameter_split(fsdp_run):
    _, outputs, _ = fsdp_run
    assert "muon: Muon:" in outputs[0]
    assert "muon:" not in outputs[1]
