"""How a process learns its place in a launch: torchrun's variables, SLURM's, or none."""

from __future__ import annotations

import pytest
import torch

from forge_lm.distributed import Launch, detect_launch
from forge_lm.distributed.launch import backend_for, rank_device
from forge_lm.errors import ConfigError


def test_no_launcher_is_one_process() -> None:
    assert detect_launch({}) == Launch(rank=0, world_size=1, local_rank=0, launcher="single")
    assert not detect_launch({}).distributed


def test_torchrun_variables() -> None:
    launch = detect_launch({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "SLURM_PROCID": "9"})
    assert launch == Launch(rank=3, world_size=4, local_rank=1, launcher="torchrun")  # torchrun wins


def test_srun_tasks_need_a_rendezvous_address() -> None:
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"}
    with pytest.raises(ConfigError) as caught:
        detect_launch(env)
    assert "MASTER_ADDR is not set" in str(caught.value)
    assert "examples/slurm" in str(caught.value)
    launch = detect_launch({**env, "MASTER_ADDR": "node1", "MASTER_PORT": "29500"})
    assert launch == Launch(rank=1, world_size=2, local_rank=1, launcher="slurm")


def test_a_single_slurm_task_is_one_process() -> None:
    assert not detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).distributed


def test_malformed_variable_is_named() -> None:
    with pytest.raises(ConfigError, match="RANK='x'"):
        detect_launch({"RANK": "x", "WORLD_SIZE": "2"})


def test_backend_follows_the_device() -> None:
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"


def test_cpu_ranks_keep_the_cpu() -> None:
    launch = Launch(rank=1, world_size=2, local_rank=1, launcher="torchrun")
    assert rank_device(torch.device("cpu"), launch) == torch.device("cpu")


def _slurm_task(local_rank: int) -> Launch:
    return Launch(rank=local_rank, world_size=8, local_rank=local_rank, launcher="slurm")


def test_a_task_that_sees_one_gpu_uses_it_whatever_its_local_rank(monkeypatch) -> None:
    """srun --gpus-per-task=1: task 3 of a node sees one GPU, its own, as cuda:0."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rank_device(torch.device("cuda"), _slurm_task(3)) == torch.device("cuda", 0)


def test_with_every_gpu_visible_local_rank_picks_its_own(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert rank_device(torch.device("cuda"), _slurm_task(3)) == torch.device("cuda", 3)
    with pytest.raises(ConfigError, match=r"local rank 5 has no GPU: this process sees 4; .*--gpus-per-task=1"):
        rank_device(torch.device("cuda"), _slurm_task(5))


def test_the_process_group_waits_as_long_as_distributed_timeout(monkeypatch) -> None:
    import datetime

    import forge_lm.distributed.launch as launch_module

    joined = {}
    monkeypatch.setattr(launch_module.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(launch_module.dist, "init_process_group", lambda **kwargs: joined.update(kwargs))
    monkeypatch.setattr(launch_module, "_OWNED_GROUP", False)
    launch_module.init_distributed(
        Launch(rank=0, world_size=2, local_rank=0, launcher="torchrun"), torch.device("cpu"), 1800
    )
    assert joined["timeout"] == datetime.timedelta(seconds=1800)
    assert joined["backend"] == "gloo"


def test_exit_process_flushes_its_output_and_keeps_the_exit_code() -> None:
    import subprocess
    import sys

    code = "from forge_lm.distributed.launch import exit_process\nprint('written', end='')\nexit_process(75)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (75, "written")
