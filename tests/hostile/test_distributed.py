"""Distributed launches gone wrong, with real processes (gloo on CPU, started as ``srun`` or
``torchrun`` would start them): a rank killed mid-run, a launch environment that claims
more ranks than were started, and a plugin's router that goes wrong on one rank only. The ranks
say what happened in one Forge message, without gloo's traceback, and exit with the code a job
script acts on."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from forge_lm.distributed.launch import detect_launch
from forge_lm.errors import ConfigError
from forge_lm.train.watchdog import HANG_EXIT_CODE

KILLER = """
import os, signal
from forge_lm import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl
def forge_lm_step_end(context, step):
    if os.environ.get("SLURM_PROCID") == "1" and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, a lost node
"""

# forge-moe's softmax top-k router, its Routing spoilt from step 3 on, on rank 1 only.
ONE_RANKS_ROUTER = """
import os
from forge_lm import hookimpl
from forge_moe.routers import Routing, SoftmaxTopKRouter

FORGE_LM_PLUGIN_API = ">=1,<2"
STEP = [0]


class Router(SoftmaxTopKRouter):
    def forward(self, x):
        r = super().forward(x)
        if STEP[0] < 2 or os.environ.get("SLURM_PROCID") != "1":
            return r
        return {spoil}


@hookimpl
def forge_lm_step_end(step):
    STEP[0] = step


@hookimpl
def forge_lm_register_routers(register):
    register("hostile_router", lambda options, dim, n, k: Router(dim, n, k), description="x")
"""

TINY = [
    "--model.dim=32",
    "--model.n_layers=1",
    "--model.n_heads=2",
    "--train.seq_len=16",
    "--train.batch_size=2",
    "--train.max_steps=6",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--data.name=synthetic",
]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_", "MASTER_", "FORGE_LM"))
    }
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1", **extra)
    return env


def _forge(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "forge_lm", "train", *TINY, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _install(site: Path, module: str, distribution: str, body: str) -> None:
    site.mkdir(exist_ok=True)
    (site / f"{module}.py").write_text(body)
    info = site / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[forge_lm]\n{module.removeprefix('forge_')} = {module}\n")


def _two_ranks(args: list[str], env: dict[str, str]) -> list[tuple[int, str]]:
    """Both ranks' exit codes and stderr, as srun starts them."""
    ranks = [_forge(args, {**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}) for rank in range(2)]
    try:
        errors = [process.communicate(timeout=180)[1] for process in ranks]
        return [(process.returncode, err) for process, err in zip(ranks, errors, strict=True)]
    finally:
        for process in ranks:
            process.kill()
            process.communicate()


def _first_error(stderr: str) -> str:
    return next((line for line in stderr.splitlines() if line.startswith("forge: error:")), "")


def test_a_killed_rank_leaves_the_other_with_one_message_and_the_hang_code(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _install(site, "forge_killer", "forge-killer", KILLER)
    env = _env(SLURM_NTASKS="2", PYTHONPATH=str(site))
    args = [f"--train.output_dir={tmp_path / 'run'}", "--distributed.timeout=60", "--checkpoint.interval=1"]
    ranks = [_forge(args, {**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}) for rank in range(2)]
    try:
        _, err0 = ranks[0].communicate(timeout=120)
    finally:
        ranks[1].kill()
        ranks[1].communicate()
    assert ranks[1].returncode == -9
    assert ranks[0].returncode == HANG_EXIT_CODE, err0
    assert "Traceback" not in err0
    assert _first_error(err0).startswith("forge: error: the connection to another rank of the run closed ("), err0
    assert "that rank stopped (killed, out of memory, its node lost)" in err0
    assert (tmp_path / "run" / "checkpoints" / "step_1").is_dir()  # written before the rank died, kept


@pytest.mark.parametrize(
    ("variables", "claimed"),
    [
        ({"SLURM_NTASKS": "3", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, "SLURM_NTASKS=3, from slurm"),
        ({"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE=3, from torchrun"),
    ],
    ids=["slurm-ntasks", "world-size"],
)
def test_more_ranks_claimed_than_started_is_named_before_anything_is_written(tmp_path, variables, claimed) -> None:
    run = tmp_path / "run"
    process = _forge([f"--train.output_dir={run}", "--distributed.timeout=3"], _env(**variables))
    _, err = process.communicate(timeout=120)
    assert process.returncode == 2, err
    assert "Traceback" not in err
    assert _first_error(err).startswith(f"forge: error: rank 0 could not join the run's 3 ranks ({claimed}) at "), err
    assert "1/3 clients joined" in err
    # Said while it waited, before the timeout's message: what is expected, and for how long.
    name = claimed.partition("=")[0]
    waiting = (
        f"forge: rank 0 is waiting for the run's 3 ranks (0-2, {claimed.replace(', from', ' from')}) to join at "
        f"127.0.0.1:"
    )
    assert waiting in err, err
    advice = f"gives up after [distributed] timeout = 3 s. If fewer processes were started, stop it and make {name}"
    assert advice in err
    assert err.index(waiting) < err.index("forge: error:")
    assert not run.exists()


def test_torchrun_counts_on_one_node_that_disagree_with_world_size_are_named_at_once() -> None:
    """No rendezvous needed: torchrun says how many processes it started on its one node."""
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1"}
    with pytest.raises(ConfigError, match=r"^WORLD_SIZE=3 claims 3 ranks, but torchrun started 2 processes on its"):
        detect_launch(env)
    assert detect_launch({**env, "WORLD_SIZE": "2"}).world_size == 2
    assert detect_launch({**env, "GROUP_WORLD_SIZE": "2"}).world_size == 3  # two nodes: the rendezvous decides


ROUTER_FAILED = (
    r"forge: error: router 'hostile_router' of plugin 'hostile' \(forge-hostile 1\.0\) returned {what}.*; the step "
    r"was not taken \(MoE layer \d\) \(on rank 1\)\. Training stopped at step 2; the newest checkpoint "
    r"\(step_2\) is intact\."
)


def test_a_router_failing_on_one_rank_stops_every_rank_through_the_plugin_failure_path(tmp_path: Path) -> None:
    """The routing checks' finding is agreed: rank 0, whose router is fine, stops with rank 1
    (exit 4, the router and rank 1 named, the last good step kept) instead of waiting for it in
    the next collective until the hang timeout. Rank 1's router returns None, a wrong form,
    which one process raises at once: here rank 1 goes on with a stand-in routing that makes
    the step non-finite, and the finding is raised after the step on every rank. (A wrong value,
    found on the device, takes the same agreement after the step; one run tests both paths.)"""
    site = tmp_path / "site"
    _install(site, "forge_hostile", "forge-hostile", ONE_RANKS_ROUTER.format(spoil="None"))
    what = r"None; a router returns a Routing\(indices, weights, aux_losses\)"
    args = [
        f"--train.output_dir={tmp_path / 'run'}",
        "--distributed.timeout=60",
        "--checkpoint.interval=2",
        "--model.ffn.name=moe",
        "--model.ffn.n_experts=4",
        "--model.ffn.top_k=2",
        "--model.ffn.router.name=hostile_router",
    ]
    outcomes = _two_ranks(args, _env(SLURM_NTASKS="2", PYTHONPATH=str(site)))
    for rank, (code, err) in enumerate(outcomes):
        assert code == 4, f"rank {rank}:\n{err}"
        assert "Traceback" not in err, f"rank {rank}:\n{err}"
    assert re.match(ROUTER_FAILED.format(what=what), _first_error(outcomes[0][1])), outcomes[0][1]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_2"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_2"]
