"""The start-up health check: every rank reaches the same verdict, names the bad rank (host and
device) on every rank, and never hangs when a rank's probe fails.

Two real gloo ranks under torchrun run every scenario in one process group (see
workers/health_worker.py: the faulty rank is rank 1); the verdict's rules are also checked on
made-up numbers, the CUDA path on a mocked ``torch.cuda`` (no GPU needed), and ``forge doctor``
under torchrun.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from forge_lm.cli._main import main
from forge_lm.distributed import health
from forge_lm.distributed.health import (
    HEALTH_EXIT_CODE,
    HealthCheckFailed,
    HealthReport,
    RankHealth,
    _verdict,
    check_health,
)
from forge_lm.testing.distributed import torchrun

WORKER = Path(__file__).parent / "workers" / "health_worker.py"
SCENARIOS = ("healthy", "slow_matmul", "slow_all_reduce", "failing_matmul", "wrong_matmul", "mocked_cuda")
HOST = socket.gethostname()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Each rank's results of every scenario, from one torchrun of 2 ranks."""
    out = tmp_path_factory.mktemp("health")
    result = torchrun([str(WORKER), str(out), *SCENARIOS], nproc=2, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]  # no rank hung or died
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def _same_on_both(ranks: list[dict], scenario: str) -> dict:
    """The scenario's result, after checking that both ranks reached exactly the same verdict."""
    first, second = ranks[0][scenario], ranks[1][scenario]
    assert first == second
    return first


def test_two_healthy_ranks_agree_on_a_healthy_report(ranks) -> None:
    result = _same_on_both(ranks, "healthy")

    assert result["ok"], result["message"]
    lines = result["describe"].splitlines()
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        assert line.startswith(f"rank {rank} (host {HOST}, cpu): all-reduce of 1 MiB ")
        assert " GB/s bus), matmul 256x256 " in line
        assert line.endswith("; ok")
    assert result["summary"].startswith("2 rank(s) on 1 host(s); all-reduce median ")


@pytest.mark.parametrize(
    ("scenario", "problem"),
    [
        ("slow_matmul", "the matmul took "),
        ("slow_all_reduce", "the all-reduce took "),
    ],
)
def test_a_slow_rank_is_named_on_both_ranks(ranks, scenario: str, problem: str) -> None:
    result = _same_on_both(ranks, scenario)

    assert not result["ok"]
    assert list(result["problems"]) == ["1"]  # rank 0 waited for it, but is not blamed
    assert result["problems"]["1"][0].startswith(problem)
    assert "x the other ranks' median of " in result["problems"]["1"][0]
    assert result["message"].startswith(
        "the start-up health check (resilience.health_check) found 1 of 2 ranks unfit: "
        f"rank 1 (host {HOST}, cpu): {problem}"
    )
    assert f"(SLURM: --exclude={HOST})" in result["message"]
    assert "resilience.health_check = false" in result["message"]


@pytest.mark.parametrize(
    ("scenario", "problem"),
    [
        (
            "failing_matmul",
            "matmul probe failed: RuntimeError: CUDA error: an illegal memory access was encountered (injected)",
        ),
        (
            "wrong_matmul",
            "matmul probe failed: ArithmeticError: a 256x256 matmul gave a wrong result (its checksums differ "
            "from the CPU's)",
        ),
    ],
)
def test_a_rank_whose_probe_fails_is_named_on_both_ranks_without_a_hang(ranks, scenario: str, problem: str) -> None:
    result = _same_on_both(ranks, scenario)  # both ranks got here: the failing one took part in the gather

    assert result["problems"] == {"1": [problem]}
    assert f"rank 1 (host {HOST}, cpu): {problem}" in result["message"]
    assert "matmul 256x256" not in result["describe"].splitlines()[1]  # no time for a probe that failed
    assert result["describe"].splitlines()[1].endswith(f"; FAILED: {problem}")


def test_a_gpu_held_by_another_process_is_named_on_both_ranks(ranks) -> None:
    result = _same_on_both(ranks, "mocked_cuda")

    assert result["problems"] == {
        "1": [
            "only 5.0 GiB of its GPU's memory is free, against a median of 79.0 GiB on the other ranks "
            "(another process holds this GPU?)"
        ]
    }
    assert f"rank 1 (host {HOST}, cuda:1 (NVIDIA H100 80GB HBM3)): only 5.0 GiB" in result["message"]
    rank0, rank1 = result["describe"].splitlines()
    assert rank0.startswith(f"rank 0 (host {HOST}, cuda:0 (NVIDIA H100 80GB HBM3)): all-reduce of 0.015625 MiB ")
    assert "matmul 128x128 " in rank0
    assert rank0.endswith(", 79.0 of 80.0 GiB free; ok")
    assert "5.0 of 80.0 GiB free; FAILED: only 5.0 GiB" in rank1
    assert "least free GPU memory 5.0 GiB (rank 1)" in result["summary"]


# -- the CUDA path in one process, torch.cuda mocked ----------------------------------------------


@pytest.fixture
def mocked_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """torch.cuda as on a machine with a GPU, the probes' tensors on the CPU; returns the calls."""
    calls: list[str] = []
    monkeypatch.setattr(health, "_compute_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(f"synchronize {device}"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 1024**3, 80 * 1024**3))
    monkeypatch.setitem(health._MATMUL_SIZE, "cuda", 128)  # the real 4096 would take seconds on a CPU
    return calls


def test_cuda_probes_time_the_matmul_after_synchronizing_and_read_free_memory(mocked_cuda) -> None:
    report = check_health(torch.device("cuda", 0))

    (only,) = report.ranks
    assert only.device == "cuda:0 (NVIDIA A100-SXM4-80GB)"
    assert (only.free_bytes, only.total_bytes) == (70 * 1024**3, 80 * 1024**3)
    assert only.matmul_size == 128
    assert only.matmul_s is not None
    assert only.all_reduce_s is None  # one process: nothing to all-reduce with
    assert mocked_cuda.count("synchronize cuda:0") >= 6  # after the warm-up and after each timed matmul
    assert report.describe().endswith("70.0 of 80.0 GiB free; ok")


def test_a_failing_cuda_memory_query_is_reported_not_raised(mocked_cuda, monkeypatch) -> None:
    def broken(device=None):
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)

    with pytest.raises(HealthCheckFailed) as failure:
        check_health(torch.device("cuda", 0))

    assert failure.value.exit_code == HEALTH_EXIT_CODE == 78
    assert (
        f"rank 0 (host {HOST}, cuda:0 (NVIDIA A100-SXM4-80GB)): reading the GPU's memory failed: RuntimeError: CUDA "
        "error: "
        "unspecified launch failure" in str(failure.value)
    )
    assert failure.value.report.ranks[0].matmul_s is not None  # the other probes still ran


def test_a_gather_that_fails_is_a_health_failure_naming_this_rank(monkeypatch) -> None:
    """A peer that died mid-check breaks the gather: this rank says so instead of a traceback."""

    def broken_gather(out, obj):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(health, "_all_reduce_probe", lambda device, numel: 0.001)
    monkeypatch.setattr(dist, "all_gather_object", broken_gather)

    with pytest.raises(HealthCheckFailed) as failure:
        check_health(torch.device("cpu"))

    assert str(failure.value) == (
        f"the start-up health check (resilience.health_check) could not gather the ranks' results on rank 0 (host "
        f"{HOST}, cpu): RuntimeError: Connection closed by peer [127.0.0.1]:29500. Another rank's process died or "
        "the network between the ranks is down: look for the first error in the other ranks' output, then run the "
        "same command."
    )
    assert failure.value.report is None


# -- the verdict on made-up numbers ---------------------------------------------------------------


def _rank(rank: int, **fields) -> RankHealth:
    return RankHealth(rank=rank, host=f"node{rank}", device="cpu", **fields)


def test_tiny_noisy_timings_never_trip_the_check() -> None:
    # 10x slower, but by 9 ms: CPU jitter, under the absolute gap.
    ranks = (_rank(0, matmul_s=0.001), _rank(1, matmul_s=0.010))
    assert _verdict(ranks, slow_factor=3.0, min_gap_s=0.1) == {}


def test_a_rank_over_the_factor_and_the_gap_is_named_and_only_that_one() -> None:
    ranks = (*(_rank(r, all_reduce_s=0.02) for r in range(7)), _rank(7, all_reduce_s=0.5))
    problems = _verdict(ranks, slow_factor=3.0, min_gap_s=0.005)
    assert problems == {7: ("the all-reduce took 500.00 ms, 25.0x the other ranks' median of 20.00 ms",)}


def test_slower_but_within_the_factor_is_fine() -> None:
    ranks = (_rank(0, matmul_s=1.0), _rank(1, matmul_s=2.9))
    assert _verdict(ranks, slow_factor=3.0, min_gap_s=0.005) == {}


def test_a_failed_probe_is_named_and_leaves_the_others_judged_without_it() -> None:
    ranks = (_rank(0, matmul_s=0.01), _rank(1, errors=("matmul probe failed: boom",)), _rank(2, matmul_s=0.011))
    assert _verdict(ranks, slow_factor=3.0, min_gap_s=0.005) == {1: ("matmul probe failed: boom",)}


def test_the_failure_message_names_every_bad_rank_with_host_and_device() -> None:
    ranks = (_rank(0, matmul_s=0.01), _rank(1, matmul_s=0.5), _rank(2, errors=("matmul probe failed: x",)))
    report = HealthReport(ranks, _verdict(ranks, slow_factor=3.0, min_gap_s=0.005))
    message = health._failure_message(report)

    assert message.startswith("the start-up health check (resilience.health_check) found 2 of 3 ranks unfit: ")
    assert "rank 1 (host node1, cpu): the matmul took 500.00 ms" in message
    assert "; rank 2 (host node2, cpu): matmul probe failed: x." in message
    assert "(SLURM: --exclude=node1,node2)" in message


# -- forge doctor ----------------------------------------------------------------------------------


def test_doctor_in_one_process_says_how_to_run_the_health_check(capsys, tmp_path, monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)

    main(["doctor", "--json", "--no-plugin-autoload", "--run-dir", str(tmp_path / "run")])

    rows = {row["check"]: row for row in json.loads(capsys.readouterr().out)["checks"]}
    assert rows["health"]["status"] == "ok"
    assert "runs under 'torchrun --nproc_per_node=N -m forge_lm doctor'" in rows["health"]["detail"]
    assert not any(name.startswith("health rank") for name in rows)


def test_doctor_under_torchrun_reports_the_health_check_of_each_rank(tmp_path: Path) -> None:
    args = ["-m", "forge_lm", "doctor", "--json", "--no-plugin-autoload", "--run-dir", str(tmp_path / "run")]
    result = torchrun([*args, "--train.device=cpu"], nproc=2, timeout=300)

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)  # rank 0's report alone: one JSON document
    rows = {row["check"]: (row["status"], row["detail"]) for row in report["checks"]}
    assert rows["health"] == (
        "ok",
        "2 ranks on 1 host(s): every probe passed, none far slower than the others",
    )
    for rank in (0, 1):
        status, detail = rows[f"health rank {rank}"]
        assert status == "ok"
        assert detail.startswith(f"rank {rank} (host {HOST}, cpu): all-reduce of 1 MiB ")
        assert detail.endswith("; ok")


SLOW_RANK_ONE = """
import os, sys, time
import torch
if os.environ["RANK"] == "1":
    real = torch.matmul
    def slow(a, b):
        time.sleep(0.3)
        return real(a, b)
    torch.matmul = slow
from forge_lm.cli._main import run
run()
"""


def test_doctor_under_torchrun_fails_naming_a_slow_rank(tmp_path: Path) -> None:
    script = tmp_path / "doctor.py"
    script.write_text(SLOW_RANK_ONE)
    args = ["doctor", "--json", "--no-plugin-autoload", "--run-dir", str(tmp_path / "run"), "--train.device=cpu"]
    result = torchrun([str(script), *args], nproc=2, timeout=300)

    assert result.returncode != 0  # doctor exits 1 on both ranks; torchrun reports the failure
    report = json.loads(result.stdout)
    assert report["ok"] is False
    rows = {row["check"]: (row["status"], row["detail"]) for row in report["checks"]}
    status, detail = rows["health"]
    assert status == "fail"
    assert detail.startswith("the start-up health check (resilience.health_check) found 1 of 2 ranks unfit: rank 1 ")
    assert rows["health rank 0"][0] == "ok"
    assert rows["health rank 1"][0] == "fail"
    assert "FAILED: the matmul took " in rows["health rank 1"][1]
