"""Checks of the Python environment: the interpreter, torch and the core's other dependencies,
against what the installed core declares. Also the metadata helpers the plugin checks share."""

from __future__ import annotations

import sys
from typing import Any

from forge_lm.cli._doctor._check import FAIL, OK, WARNING, Check, Context


def python(context: Context) -> list[Check]:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    from forge_lm.plugins import CORE_DISTRIBUTION

    metadata = distribution_metadata(CORE_DISTRIBUTION)
    version = ".".join(str(part) for part in sys.version_info[:3])
    found = f"Python {version} ({sys.executable})"
    if metadata is None:
        return [
            Check(
                "python",
                WARNING,
                f"{found}; {CORE_DISTRIBUTION} is not installed as a distribution, so its requirements are unknown. "
                f"Fix: pip install {CORE_DISTRIBUTION}",
            )
        ]
    declared = metadata.get("Requires-Python") or ""
    try:
        accepted = SpecifierSet(declared)
    except InvalidSpecifier:
        return [
            Check(
                "python", WARNING, f"{found}; {CORE_DISTRIBUTION} declares an unreadable Requires-Python {declared!r}"
            )
        ]
    if not accepted.contains(version, prereleases=True):
        return [
            Check(
                "python",
                FAIL,
                f"{found}, but {CORE_DISTRIBUTION} requires Python {declared}. "
                f"Fix: create the environment with a Python {declared} interpreter",
            )
        ]
    return [Check("python", OK, f"{found}; {CORE_DISTRIBUTION} requires {declared or 'any'}")]


def torch_and_dependencies(context: Context) -> list[Check]:
    """Imports torch (the later checks that need it find it in ``sys.modules``)."""
    from forge_lm.plugins import CORE_DISTRIBUTION

    requirements = unconditional_requirements(distribution_metadata(CORE_DISTRIBUTION))
    checks = []
    torch_requirement = next((r for r in requirements if _canonical(r.name) == "torch"), None)
    try:
        import torch
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:  # a broken install: same fix
        wanted = str(torch_requirement) if torch_requirement is not None else "torch"
        checks.append(
            Check("torch", FAIL, f"import torch failed: {type(exc).__name__}: {exc}. Fix: pip install '{wanted}'")
        )
    else:
        version = str(torch.__version__)
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
        found = f"torch {version} ({build})"
        if torch_requirement is not None and not torch_requirement.specifier.contains(version, prereleases=True):
            checks.append(
                Check(
                    "torch",
                    FAIL,
                    f"{found}, but {CORE_DISTRIBUTION} requires {torch_requirement}. "
                    f"Fix: pip install '{torch_requirement}' (the build for your CUDA version: see pytorch.org)",
                )
            )
        else:
            wanted = f"; {CORE_DISTRIBUTION} requires {torch_requirement}" if torch_requirement is not None else ""
            checks.append(Check("torch", OK, f"{found}{wanted}"))
    others = [r for r in requirements if _canonical(r.name) != "torch"]
    problems = [problem for problem in map(unmet, others) if problem]
    if problems:
        checks.append(
            Check(
                "dependencies",
                FAIL,
                f"{CORE_DISTRIBUTION} needs: {'; '.join(problems)}. Fix: pip install "
                + " ".join(f"'{r}'" for r in others if unmet(r)),
            )
        )
    elif others:
        checks.append(Check("dependencies", OK, f"the {len(others)} other requirements of {CORE_DISTRIBUTION} are met"))
    return checks


CHECKS = (python, torch_and_dependencies)


# -- installed distributions --------------------------------------------------------------------


def distribution_metadata(name: str) -> Any:
    """The installed distribution's metadata (an email.message.Message), or None."""
    import importlib.metadata

    try:
        return importlib.metadata.metadata(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def unconditional_requirements(metadata: Any) -> list[Any]:
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


def unmet(requirement: Any) -> str | None:
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
