"""``forge doctor [CONFIG] [--section.key=value ...]``: can this environment run Forge?

Each check reports ``ok``, ``warning`` or ``fail`` with what it found and, for anything not
ok, how to fix it: Python and torch against the core's declared requirements, the core's
other dependencies, the GPU and NCCL where a GPU is expected (CPU only is fine), the
``torch.distributed`` backends, every plugin (broken, incompatible, or installed beside a core
its distribution does not accept), the run config and the devices it asks for, free disk
and writable paths for the run directory.

Under ``torchrun --nproc_per_node=N -m forge_lm doctor`` (or ``srun`` with one task per rank)
every rank runs the checks, joins the process group and runs the start-up health check of
``forge train`` (:mod:`forge_lm.distributed.health`: a timed all-reduce, and on GPUs a checked
matmul and the free memory of every device), reported as one row per rank. Rank 0 prints the
report; another rank prints only its own failed checks, to stderr, so that the output stays one
table (or one JSON document).

The checks live in one module per section, each listing its check functions in order in
``CHECKS``; :data:`SECTIONS` orders the sections, and the report shows the rows in that order.
A check is a function of the shared :class:`~forge_lm.cli._doctor._check.Context` returning its
rows, so adding one is writing that function in its section's module and naming it in
``CHECKS``. A check that raises is one failed row naming it; the checks after it still run.

Exit code: 0 when nothing failed (warnings are allowed: the run can go ahead, maybe slower or
with less), 1 when a check failed, 2 for a usage error (as every command).
"""

from __future__ import annotations

import sys
from typing import Any

from forge_lm.cli._doctor import _config, _environment, _gpu, _health, _paths, _plugins
from forge_lm.cli._doctor._check import FAIL, Check, Context, report, run_check

HELP = "check that this environment can run Forge (versions, GPU, plugins, disk); exit 1 if not"
TAKES_OVERRIDES = True

FAILED_EXIT_CODE = 1
DEFAULT_MIN_FREE_GIB = 10.0

# The order of the report, and of the checks: a later check may use what an earlier one found,
# torch (imported by the environment checks) and the valid config (from the config check).
SECTIONS = (
    _environment,  # python, torch, dependencies
    _gpu,  # gpu, distributed
    _plugins,  # core plugins, plugins or plugin NAME, plugin switches
    _config,  # config, device, precision, peak flops
    _health,  # health, health rank N
    _paths,  # run directory, disk, checkpoints, cache directory
)


def add_arguments(parser) -> None:
    from forge_lm.cli._main import add_config_argument, add_plugin_switches

    add_config_argument(parser)
    parser.add_argument(
        "--run-dir",
        metavar="DIR",
        help="the run directory to check for space and write access (default: the config's train.output_dir, "
        "or the current directory when the config is invalid)",
    )
    parser.add_argument(
        "--min-free-gib",
        type=float,
        default=DEFAULT_MIN_FREE_GIB,
        metavar="N",
        help=f"warn when the run directory's disk has less free space than this (default {DEFAULT_MIN_FREE_GIB:g})",
    )
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    add_plugin_switches(parser, after_command=True)


def run(args, overrides, plugins) -> int:
    from forge_lm.cli._main import checked_config_file
    from forge_lm.cli._status import working

    path = checked_config_file(args.config_file)
    with working("checking versions, devices, plugins, the config and disk"):
        checks = diagnose(plugins(), path, overrides, run_dir=args.run_dir, min_free_gib=args.min_free_gib)
    rank = _health.launch_rank()
    if rank == 0:
        report(checks, as_json=args.json)
    else:  # the health rows are the same on every rank; rank 0 shows them
        for what, status, detail in checks:
            if status == FAIL and not what.startswith("health"):
                print(f"forge doctor: rank {rank}: {what}: {detail}", file=sys.stderr)
    return FAILED_EXIT_CODE if any(check.status == FAIL for check in checks) else 0


def diagnose(
    manager: Any,
    config_path: str | None,
    overrides: list[str],
    *,
    run_dir: str | None,
    min_free_gib: float,
) -> list[Check]:
    """Every check of every section, in the order they are shown."""
    context = Context(manager, config_path, overrides, run_dir, min_free_gib)
    return [row for section in SECTIONS for check in section.CHECKS for row in run_check(check, context)]
