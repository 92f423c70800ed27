"""The multi-rank health check: under ``torchrun`` (or ``srun`` with one task per rank) every
rank joins the process group and runs the start-up health check of ``forge train``
(:mod:`forge_lm.distributed.health`); outside such a launch, one row saying how to run it."""

from __future__ import annotations

from forge_lm.cli._doctor._check import FAIL, OK, Check, Context


def health(context: Context) -> list[Check]:
    """One row for the verdict and one per rank. Runs on every rank whatever failed before it,
    as the other ranks wait for this one in the process group."""
    if context.torch is None:
        return []
    from forge_lm.distributed.health import HealthCheckFailed, check_health
    from forge_lm.distributed.launch import detect_launch, init_distributed, rank_device, shutdown_distributed
    from forge_lm.errors import ForgeError
    from forge_lm.train.device import resolve_device

    try:
        launch = detect_launch()
    except ForgeError as exc:
        return [Check("health", FAIL, str(exc))]
    if not launch.distributed:
        return [
            Check(
                "health",
                OK,
                "one process: the multi-rank health check (a timed all-reduce; on GPUs a checked matmul and the "
                "free memory of every device) runs under 'torchrun --nproc_per_node=N -m forge_lm doctor'",
            )
        ]
    config = context.config
    setting = config.train.device if config is not None else "auto"
    timeout = config.distributed.timeout if config is not None else 600.0
    try:
        device = rank_device(resolve_device(setting), launch)
        init_distributed(launch, device, timeout)
    except ForgeError as exc:
        # This rank cannot join: the others wait for it until [distributed] timeout runs out.
        return [Check("health", FAIL, f"rank {launch.rank} cannot join the process group: {exc}")]
    except Exception as exc:  # noqa: BLE001 - the rendezvous failed (address, port, network): torch's own errors
        return [
            Check(
                "health",
                FAIL,
                f"rank {launch.rank} could not join the process group of {launch.world_size} ranks: "
                f"{type(exc).__name__}: {exc}. Fix: check MASTER_ADDR/MASTER_PORT and the network between the nodes",
            )
        ]
    try:
        report, failure = check_health(device), None
    except HealthCheckFailed as exc:
        report, failure = exc.report, exc
    if report is None:  # the results could not even be gathered
        shutdown_distributed()
        return [Check("health", FAIL, str(failure))]
    shutdown_distributed(wait_for_all=True)  # every rank reached the gather: none is missing
    if failure is not None:
        verdict = Check("health", FAIL, str(failure))
    else:
        verdict = Check(
            "health",
            OK,
            f"{len(report.ranks)} ranks on {len({h.host for h in report.ranks})} host(s): every probe passed, "
            "none far slower than the others",
        )
    return [
        verdict,
        *(
            Check(f"health rank {h.rank}", FAIL if h.rank in report.problems else OK, report.describe_rank(h))
            for h in report.ranks
        ),
    ]


CHECKS = (health,)


def launch_rank() -> int:
    """This process's rank when launched as one of several (0 otherwise)."""
    from forge_lm.errors import ForgeError

    try:
        from forge_lm.distributed.launch import detect_launch

        return detect_launch().rank
    except (ImportError, ForgeError):
        return 0
