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

Exit code: 0 when nothing failed (warnings are allowed: the run can go ahead, maybe slower or
with less), 1 when a check failed, 2 for a usage error (as every command).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

HELP = "check that this environment can run Forge (versions, GPU, plugins, disk); exit 1 if not"
TAKES_OVERRIDES = True

FAILED_EXIT_CODE = 1
DEFAULT_MIN_FREE_GIB = 10.0

OK, WARNING, FAIL = "ok", "warning", "fail"
_GIB = 1024**3


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

    path = checked_config_file(args.config_file)
    checks = diagnose(plugins(), path, overrides, run_dir=args.run_dir, min_free_gib=args.min_free_gib)
    rank = _launch_rank()
    if rank == 0:
        report(checks, as_json=args.json)
    else:  # the health rows are the same on every rank; rank 0 shows them
        for what, status, detail in checks:
            if status == FAIL and not what.startswith("health"):
                print(f"forge doctor: rank {rank}: {what}: {detail}", file=sys.stderr)
    return FAILED_EXIT_CODE if any(status == FAIL for _, status, _ in checks) else 0


Check = tuple[str, str, str]  # (what, ok/warning/fail, what was found and how to fix it)


def diagnose(
    manager: Any,
    config_path: str | None,
    overrides: list[str],
    *,
    run_dir: str | None,
    min_free_gib: float,
) -> list[Check]:
    """Every check, in the order they are shown."""
    from forge_lm.plugins import CORE_DISTRIBUTION

    metadata = _distribution_metadata(CORE_DISTRIBUTION)
    requirements = _requirements(metadata)
    checks = [_check_python(metadata), *_check_torch_and_dependencies(requirements)]
    torch = sys.modules.get("torch")
    if torch is not None:
        checks.append(_check_gpu(torch))
        checks.append(_check_distributed(torch))
    checks.extend(_check_plugins(manager))
    config, config_check = _check_config(manager, config_path, overrides)
    checks.append(config_check)
    if config is not None and torch is not None:
        checks.append(_check_device(config))
        checks.extend(_check_peak_flops(config))
    if torch is not None:  # on every rank, whatever failed above: the other ranks wait for this one
        checks.extend(_check_health(config))
    directory = Path(run_dir if run_dir is not None else config.train.output_dir if config is not None else ".")
    checks.extend(_check_run_dir(directory, min_free_gib))
    if torch is not None and (directory / "checkpoints").is_dir():
        checks.append(_check_checkpoints(directory))
    checks.append(_check_cache_dir())
    return checks


# -- Python, torch and the core's dependencies --------------------------------------------------


def _distribution_metadata(name: str) -> Any:
    """The installed distribution's metadata (an email.message.Message), or None."""
    import importlib.metadata

    try:
        return importlib.metadata.metadata(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _requirements(metadata: Any) -> list[Any]:
    """The unconditional requirements (no extra) declared in ``metadata``."""
    from packaging.requirements import InvalidRequirement, Requirement

    found = []
    for line in (metadata.get_all("Requires-Dist") if metadata is not None else None) or []:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            found.append(requirement)
    return found


def _check_python(metadata: Any) -> Check:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    from forge_lm.plugins import CORE_DISTRIBUTION

    version = ".".join(str(part) for part in sys.version_info[:3])
    found = f"Python {version} ({sys.executable})"
    if metadata is None:
        return (
            "python",
            WARNING,
            f"{found}; {CORE_DISTRIBUTION} is not installed as a distribution, so its requirements are unknown. "
            f"Fix: pip install {CORE_DISTRIBUTION}",
        )
    declared = metadata.get("Requires-Python") or ""
    try:
        accepted = SpecifierSet(declared)
    except InvalidSpecifier:
        return "python", WARNING, f"{found}; {CORE_DISTRIBUTION} declares an unreadable Requires-Python {declared!r}"
    if not accepted.contains(version, prereleases=True):
        return (
            "python",
            FAIL,
            f"{found}, but {CORE_DISTRIBUTION} requires Python {declared}. "
            f"Fix: create the environment with a Python {declared} interpreter",
        )
    return "python", OK, f"{found}; {CORE_DISTRIBUTION} requires {declared or 'any'}"


def _check_torch_and_dependencies(requirements: list[Any]) -> list[Check]:
    from forge_lm.plugins import CORE_DISTRIBUTION

    checks = []
    torch_requirement = next((r for r in requirements if _canonical(r.name) == "torch"), None)
    try:
        import torch
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:  # a broken install: same fix
        wanted = str(torch_requirement) if torch_requirement is not None else "torch"
        checks.append(("torch", FAIL, f"import torch failed: {type(exc).__name__}: {exc}. Fix: pip install '{wanted}'"))
    else:
        version = str(torch.__version__)
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
        found = f"torch {version} ({build})"
        if torch_requirement is not None and not torch_requirement.specifier.contains(version, prereleases=True):
            checks.append(
                (
                    "torch",
                    FAIL,
                    f"{found}, but {CORE_DISTRIBUTION} requires {torch_requirement}. "
                    f"Fix: pip install '{torch_requirement}' (the build for your CUDA version: see pytorch.org)",
                )
            )
        else:
            wanted = f"; {CORE_DISTRIBUTION} requires {torch_requirement}" if torch_requirement is not None else ""
            checks.append(("torch", OK, f"{found}{wanted}"))
    others = [r for r in requirements if _canonical(r.name) != "torch"]
    problems = [problem for problem in map(_unmet, others) if problem]
    if problems:
        checks.append(
            (
                "dependencies",
                FAIL,
                f"{CORE_DISTRIBUTION} needs: {'; '.join(problems)}. Fix: pip install "
                + " ".join(f"'{r}'" for r in others if _unmet(r)),
            )
        )
    elif others:
        checks.append(("dependencies", OK, f"the {len(others)} other requirements of {CORE_DISTRIBUTION} are met"))
    return checks


def _unmet(requirement: Any) -> str | None:
    """Why ``requirement`` is not met in this environment, or None when it is."""
    import importlib.metadata

    try:
        version = importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        return f"{requirement} (not installed)"
    if not requirement.specifier.contains(version, prereleases=True):
        return f"{requirement} ({version} installed)"
    return None


def _canonical(name: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)


# -- GPU, NCCL and torch.distributed ------------------------------------------------------------


def _gpu_hint() -> str | None:
    """A sign that this machine has an NVIDIA GPU (whether or not torch can use it), or None."""
    import shutil

    if Path("/dev/nvidiactl").exists():
        return "/dev/nvidiactl exists"
    if shutil.which("nvidia-smi"):
        return "nvidia-smi is installed"
    return None


def _check_gpu(torch: Any) -> Check:
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        found = f"{count} GPU(s): {', '.join(names)}; CUDA {torch.version.cuda}"
        if not torch.cuda.is_bf16_supported():
            return (
                "gpu",
                WARNING,
                f"{found}; bf16 is not supported, and runs on CUDA use it by default. "
                "Fix: set train.precision = 'fp32' (--train.precision=fp32)",
            )
        return "gpu", OK, found
    hint = _gpu_hint()
    if hint is None:
        return "gpu", OK, "CPU only (no GPU found): training runs on the CPU"
    why = (
        f"torch {torch.__version__} is a CPU build"
        if not torch.version.cuda
        else f"this CUDA {torch.version.cuda} build of torch sees no device (driver, or CUDA_VISIBLE_DEVICES)"
    )
    return (
        "gpu",
        WARNING,
        f"a GPU seems present ({hint}) but torch cannot use it: {why}; runs will use the CPU. "
        "Fix: install the torch build for this machine's CUDA driver (see pytorch.org), or check nvidia-smi",
    )


def _check_distributed(torch: Any) -> Check:
    if not torch.distributed.is_available():
        return (
            "distributed",
            FAIL,
            "this torch build has no torch.distributed, which checkpoints and multi-process runs need. "
            "Fix: install an official torch build (pip install torch)",
        )
    backends = []
    if torch.distributed.is_gloo_available():
        backends.append("gloo")
    cuda = torch.cuda.is_available()
    if cuda and torch.distributed.is_nccl_available():
        version = torch.cuda.nccl.version()
        backends.append(f"nccl {'.'.join(map(str, version)) if isinstance(version, tuple) else version}")
    found = f"backends: {', '.join(backends) or 'none'}"
    if cuda and not any(b.startswith("nccl") for b in backends):
        return (
            "distributed",
            FAIL,
            f"{found}; runs on GPUs communicate through NCCL, which this torch build lacks. "
            "Fix: install an official CUDA build of torch (it bundles NCCL)",
        )
    if "gloo" not in backends:
        status = WARNING if cuda else FAIL
        return (
            "distributed",
            status,
            f"{found}; CPU runs communicate through gloo, which this torch build lacks. "
            "Fix: install an official torch build (pip install torch)",
        )
    return "distributed", OK, found + ("" if cuda else " (nccl is needed only with CUDA)")


def _launch_rank() -> int:
    """This process's rank when launched as one of several (0 otherwise)."""
    from forge_lm.errors import ForgeError

    try:
        from forge_lm.distributed.launch import detect_launch

        return detect_launch().rank
    except (ImportError, ForgeError):
        return 0


def _check_health(config: Any) -> list[Check]:
    """Under torchrun (or srun with one task per rank): join the process group and run the
    start-up health check of ``forge train`` on every rank; one row for the verdict and one
    per rank. Outside such a launch, one row saying how to run it."""
    from forge_lm.distributed.health import HealthCheckFailed, check_health
    from forge_lm.distributed.launch import detect_launch, init_distributed, rank_device, shutdown_distributed
    from forge_lm.errors import ForgeError
    from forge_lm.train.device import resolve_device

    try:
        launch = detect_launch()
    except ForgeError as exc:
        return [("health", FAIL, str(exc))]
    if not launch.distributed:
        return [
            (
                "health",
                OK,
                "one process: the multi-rank health check (a timed all-reduce; on GPUs a checked matmul and the "
                "free memory of every device) runs under 'torchrun --nproc_per_node=N -m forge_lm doctor'",
            )
        ]
    setting = config.train.device if config is not None else "auto"
    timeout = config.distributed.timeout if config is not None else 600.0
    try:
        device = rank_device(resolve_device(setting), launch)
        init_distributed(launch, device, timeout)
    except ForgeError as exc:
        # This rank cannot join: the others wait for it until [distributed] timeout runs out.
        return [("health", FAIL, f"rank {launch.rank} cannot join the process group: {exc}")]
    except Exception as exc:  # noqa: BLE001 - the rendezvous failed (address, port, network): torch's own errors
        return [
            (
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
        return [("health", FAIL, str(failure))]
    shutdown_distributed(wait_for_all=True)  # every rank reached the gather: none is missing
    world = len(report.ranks)
    if failure is not None:
        verdict = ("health", FAIL, str(failure))
    else:
        verdict = (
            "health",
            OK,
            f"{world} ranks on {len({h.host for h in report.ranks})} host(s): every probe passed, none far slower "
            "than the others",
        )
    rows = [verdict]
    for health in report.ranks:
        status = FAIL if health.rank in report.problems else OK
        rows.append((f"health rank {health.rank}", status, report.describe_rank(health)))
    return rows


# -- plugins and the run config -----------------------------------------------------------------


def _check_plugins(manager: Any) -> list[Check]:
    from forge_lm.plugins import CORE_DISTRIBUTION, PluginStatus, core_version

    checks: list[Check] = []
    builtins = [p for p in manager.plugins if p.builtin]
    damaged = [p for p in builtins if p.status in (PluginStatus.BROKEN, PluginStatus.INCOMPATIBLE)]
    if damaged:
        checks.append(
            (
                "core plugins",
                FAIL,
                "; ".join(f"'{p.name}' is {p.status}: {p.reason}" for p in damaged)
                + f". Fix: pip install --force-reinstall '{CORE_DISTRIBUTION}=={core_version()}'",
            )
        )
    else:
        off = [p.name for p in builtins if p.status is PluginStatus.DISABLED]
        note = f" ({', '.join(off)} disabled by a switch)" if off else ""
        checks.append(("core plugins", OK, f"{CORE_DISTRIBUTION} {core_version()}: {len(builtins)} built-ins{note}"))
    third_party = [p for p in manager.plugins if not p.builtin]
    if not third_party:
        checks.append(("plugins", OK, "no third-party plugin installed"))
    for plugin in third_party:
        checks.append(_check_plugin(plugin))
    for warning in manager.warnings:
        checks.append(("plugin switches", WARNING, warning))
    return checks


def _check_plugin(plugin: Any) -> Check:
    from forge_lm.plugins import PluginStatus

    what = f"plugin {plugin.name}"
    dist = plugin.distribution
    found = f"{dist} {plugin.version}"
    if plugin.status is PluginStatus.BROKEN:
        return (
            what,
            FAIL,
            f"{found} is broken: {plugin.reason}. Fix: reinstall it with its dependencies "
            f"(pip install --force-reinstall {dist}), uninstall it (pip uninstall {dist}), "
            f"or run without it (--block-plugin {plugin.name})",
        )
    if plugin.status is PluginStatus.INCOMPATIBLE:
        return (
            what,
            FAIL,
            f"{found} is incompatible: {plugin.reason}. Fix: pip install --upgrade {dist}, or pip uninstall {dist}",
        )
    unmet = [problem for problem in map(_unmet, _requirements(_distribution_metadata(dist))) if problem]
    if unmet:
        return (
            what,
            FAIL,
            f"{found} needs {'; '.join(unmet)}. Fix: pip install --upgrade {dist} (a release made for what is "
            f"installed) or install what it needs",
        )
    if plugin.status is PluginStatus.DISABLED:
        return what, OK, f"{found}: disabled ({plugin.reason})"
    components = sum(len(names) for names in plugin.components.values())
    return what, OK, f"{found}: {components} component(s)"


def _check_config(manager: Any, path: str | None, overrides: list[str]) -> tuple[Any, Check]:
    from forge_lm.config import load_config
    from forge_lm.errors import ForgeError

    what = path or "the default config"
    if overrides:
        what += f" with {len(overrides)} override(s)"
    try:
        config = load_config(path, overrides, manager.registry)
        manager.configure(config)
    except ForgeError as exc:
        return None, ("config", FAIL, f"{what}: {exc}")
    return config, ("config", OK, f"{what} is valid")


def _check_device(config: Any) -> Check:
    from forge_lm.errors import ForgeError
    from forge_lm.train.device import resolve_device

    setting = config.train.device
    try:
        device = resolve_device(setting)
    except ForgeError as exc:
        return "device", FAIL, str(exc)
    return "device", OK, f"train.device '{setting}': the run computes on {device}"


def _check_peak_flops(config: Any) -> list[Check]:
    """The peak FLOP/s that MFU divides by, and where it comes from; nothing when the device
    does not resolve (the device row says why). A check stays quick, so a CPU peak that would
    have to be measured is only announced: the first run measures it."""
    from forge_lm.errors import ForgeError
    from forge_lm.metrics.mfu import known_cpu_peak, peak_with_source
    from forge_lm.train.device import autocast_dtype, resolve_device

    try:
        device = resolve_device(config.train.device)
    except ForgeError:
        return []
    dtype = autocast_dtype(config.train.precision, device)
    what = f"{device.type} {'bf16' if dtype is not None else 'fp32'}"  # autocast_dtype: bf16 or None
    configured = config.metrics.peak_flops
    try:
        if device.type == "cpu" and configured is None:
            import torch

            peak, source = known_cpu_peak(torch.float32 if dtype is None else dtype)
        else:
            peak, source = peak_with_source(device, dtype, configured)
    except ForgeError as exc:
        found = str(exc).removeprefix("[metrics] peak_flops: ")
        return [("peak flops", WARNING, f"{what}: {found} Until then training logs no MFU")]
    if peak is None:
        return [("peak flops", OK, f"{what}: {source}")]
    return [("peak flops", OK, f"{what}: {peak:.3g} FLOP/s, {source}")]


# -- disk and writable paths --------------------------------------------------------------------


def _existing_ancestor(path: Path) -> Path:
    """``path`` itself if it exists, else the nearest ancestor that does."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe_writable(directory: Path) -> None:
    """Create and delete a file in ``directory``; raises OSError when that is not possible."""
    import os
    import tempfile

    handle, name = tempfile.mkstemp(prefix=".forge-doctor-", dir=directory)
    os.close(handle)
    os.unlink(name)


def _check_run_dir(directory: Path, min_free_gib: float) -> list[Check]:
    import shutil

    existing = _existing_ancestor(directory)
    where = str(directory)
    if not existing.is_dir():
        blocked = (
            f"{where} exists and is not a directory"
            if existing == directory.absolute()
            else f"{where} cannot be created: {existing} is not a directory"
        )
        return [("run directory", FAIL, f"{blocked}. Fix: choose another --train.output_dir")]
    try:
        _probe_writable(existing)
    except OSError as exc:
        return [
            (
                "run directory",
                FAIL,
                f"{where}: cannot write in {existing}: {exc.strerror or exc}. "
                "Fix: choose a writable --train.output_dir, or give this user write access",
            )
        ]
    found = f"{where} is writable" if existing == directory.absolute() else f"{where} will be created in {existing}"
    checks = [("run directory", OK, found)]
    free = shutil.disk_usage(existing).free / _GIB
    if free < min_free_gib:
        checks.append(
            (
                "disk",
                WARNING,
                f"{free:.1f} GiB free at {existing}, under {min_free_gib:g} GiB: checkpoints may not fit. "
                "Fix: free space, choose another --train.output_dir, "
                "or keep fewer checkpoints (checkpoint.keep_last_n)",
            )
        )
    else:
        checks.append(("disk", OK, f"{free:.1f} GiB free at {existing}"))
    return checks


def _check_checkpoints(directory: Path) -> Check:
    """The run's checkpoints, read as resuming reads them (no tensor loaded): which one a
    resumed run would start from, and why any newer one would be passed over."""
    from forge_lm.checkpoint import CheckpointManager

    survey = CheckpointManager(directory).survey()
    unsafe = [f"{path.name}: {problem[8:]}" for path, problem in survey if problem and problem.startswith("UNSAFE: ")]
    if unsafe:
        return "checkpoints", FAIL, f"{unsafe[0]}. Fix: remove that checkpoint; never load it"
    usable = next((path for path, problem in survey if problem is None), None)
    newer = [(path, problem) for path, problem in survey if usable and _step(path) > _step(usable)]
    skipped = [f"{path.name} ({problem})" for path, problem in newer]
    if usable is None:
        if not survey:
            return "checkpoints", OK, "none yet"
        return "checkpoints", FAIL, f"none usable: {survey[0][0].name} ({survey[0][1]}). Fix: remove the damaged ones"
    if skipped:
        return "checkpoints", WARNING, f"a resumed run starts from {usable.name}; passed over: {'; '.join(skipped)}"
    return "checkpoints", OK, f"a resumed run starts from {usable.name}"


def _step(path: Path) -> int:
    from forge_lm.checkpoint import step_of

    return step_of(path) or 0


def _check_cache_dir() -> Check:
    from forge_lm.metrics.mfu import cache_path

    directory = cache_path().parent
    existing = _existing_ancestor(directory)
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, "not a directory", str(existing))
        _probe_writable(existing)
    except OSError as exc:
        return (
            "cache directory",
            WARNING,
            f"{directory}: {exc.strerror or exc}; the CPU's peak FLOP/s (for MFU) will be measured again at every run. "
            "Fix: set XDG_CACHE_HOME to a writable directory, or metrics.peak_flops",
        )
    return "cache directory", OK, f"{directory} is writable"


# -- the report ---------------------------------------------------------------------------------

_STYLE = {OK: "green", WARNING: "yellow", FAIL: "red"}


def report(checks: list[Check], *, as_json: bool) -> None:
    failed = sum(status == FAIL for _, status, _ in checks)
    warned = sum(status == WARNING for _, status, _ in checks)
    if as_json:
        import json

        rows = [{"check": what, "status": status, "detail": detail} for what, status, detail in checks]
        print(json.dumps({"ok": not failed, "checks": rows}, indent=2))
        return
    import shutil

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title="forge doctor", title_justify="left", show_lines=True)
    for column in ("Check", "Status", "Detail"):
        table.add_column(column, overflow="fold")
    for what, status, detail in checks:
        table.add_row(Text(what), Text(status, style=_STYLE[status]), Text(detail))  # no markup: [train] ...
    console = Console(width=max(120, shutil.get_terminal_size((120, 24)).columns), soft_wrap=False)
    console.print(table)
    if failed:
        summary = f"{failed} check(s) failed"
        summary += f", {warned} warning(s)" if warned else ""
        console.print(f"{summary}: fix the failures above before training.", style="red", highlight=False)
    elif warned:
        console.print(f"ready to train, with {warned} warning(s).", style="yellow", highlight=False)
    else:
        console.print("ready to train: every check passed.", style="green", highlight=False)
