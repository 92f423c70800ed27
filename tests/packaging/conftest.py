"""The distributions as users get them: built once per session with ``make dist``.

``wheelhouse`` runs the documented command (``make dist``) into a temporary directory, so
the tests check exactly what a release would publish. ``reused_site`` is a directory of
symlinks to the third-party packages those wheels declare (torch, numpy, wandb and everything
they need), taken from the running environment, so that a fresh virtual environment can
install the wheels offline without downloading torch again. Only what the wheels declare,
followed through their dependencies, is linked: a dependency a distribution forgets to
declare is missing there, exactly as it would be for a user.
"""

from __future__ import annotations

import email
import importlib.metadata
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {  # distribution name -> its directory; the order of PACKAGES in the Makefile
    "forge-lm": REPO / "core",
    "forge-moe": REPO / "plugins" / "forge-moe",
    "forge-deepseek": REPO / "plugins" / "forge-deepseek",
    "forge-optim-muon": REPO / "plugins" / "forge-optim-muon",
    "forge-wandb": REPO / "plugins" / "forge-wandb",
    "forge-prometheus": REPO / "plugins" / "forge-prometheus",
    "forge-lm-eval": REPO / "plugins" / "forge-lm-eval",
    "forge-float8": REPO / "plugins" / "forge-float8",
    "forge-vlm": REPO / "plugins" / "forge-vlm",
}
CORE = "forge-lm"


def pyproject(distribution: str) -> dict:
    return tomllib.loads((PACKAGES[distribution] / "pyproject.toml").read_text())["project"]


def wheel_of(wheelhouse: Path, distribution: str) -> Path:
    name = distribution.replace("-", "_")
    return wheelhouse / f"{name}-{pyproject(distribution)['version']}-py3-none-any.whl"


def sdist_of(wheelhouse: Path, distribution: str) -> Path:
    name = distribution.replace("-", "_")
    return wheelhouse / f"{name}-{pyproject(distribution)['version']}.tar.gz"


def dist_info_file(wheel: Path, name: str) -> str:
    """The text of ``*.dist-info/<name>`` in ``wheel``."""
    with zipfile.ZipFile(wheel) as archive:
        (member,) = [m for m in archive.namelist() if m.split("/", 1) == [_dist_info(archive), name]]
        return archive.read(member).decode()


def _dist_info(archive: zipfile.ZipFile) -> str:
    (folder,) = {m.split("/")[0] for m in archive.namelist() if m.split("/")[0].endswith(".dist-info")}
    return folder


def wheel_metadata(wheel: Path) -> email.message.Message:
    return email.message_from_string(dist_info_file(wheel, "METADATA"))


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory) -> Path:
    """``make dist`` into a temporary directory: a wheel and an sdist of each distribution.

    ``-o`` keeps make from redoing the set-up (this environment is already set up), and
    ``PY`` is this interpreter, with its ``build`` and setuptools.
    """
    out = tmp_path_factory.mktemp("wheelhouse") / "dist"
    done = subprocess.run(
        ["make", "--no-print-directory", "-o", ".venv/.forge-installed", "dist",
         f"DIST={out}", f"PY={sys.executable}"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _declared(wheel: Path) -> list[Requirement]:
    return [Requirement(line) for line in wheel_metadata(wheel).get_all("Requires-Dist") or []]


@pytest.fixture(scope="session")
def reused_site(wheelhouse, tmp_path_factory) -> Path:
    """Symlinks to the installed third-party distributions the wheels need, and to nothing else."""
    ours = {canonicalize_name(name) for name in PACKAGES}
    # (requirement, the extra of the distribution that asked for it, "" for none)
    wanted = [(r, "") for name in PACKAGES for r in _declared(wheel_of(wheelhouse, name))]
    found: dict[str, importlib.metadata.Distribution] = {}
    followed: set[tuple[str, str]] = set()  # (distribution, extra) whose requirements are queued
    while wanted:
        requirement, extra = wanted.pop()
        key = canonicalize_name(requirement.name)
        if key in ours:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        if key not in found:
            dist = importlib.metadata.distribution(requirement.name)
            assert requirement.specifier.contains(dist.version, prereleases=True), (requirement, dist.version)
            found[key] = dist
        # A requirement with extras (datasets needs fsspec[http]) brings what those extras need too.
        for wanted_extra in ("", *sorted(requirement.extras)):
            if (key, wanted_extra) not in followed:
                followed.add((key, wanted_extra))
                wanted.extend((Requirement(line), wanted_extra) for line in found[key].requires or [])
    site = tmp_path_factory.mktemp("reused-site")
    for dist in found.values():
        root = Path(dist.locate_file(""))
        assert dist.files is not None, f"{dist.metadata['Name']} has no RECORD to find its files by"
        tops = {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}
        for top in sorted(tops):
            if top.endswith(".pth") or (site / top).exists() or not (root / top).exists():
                continue
            (site / top).symlink_to(root / top)
    linked = {p.name for p in site.iterdir()}
    assert not any(name.startswith(("forge_", "forge-")) for name in linked), linked
    return site
