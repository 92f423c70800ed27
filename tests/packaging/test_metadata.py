"""What ``make dist`` builds carries the right metadata, license, README and files.

Read straight from the built archives (``zipfile``, ``tarfile``), as pip and PyPI read them.
"""

from __future__ import annotations

import configparser
import re
import tarfile
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from readme_renderer.markdown import render

from .conftest import CORE, PACKAGES, REPO, dist_info_file, pyproject, sdist_of, wheel_metadata, wheel_of

PLUGINS = [name for name in PACKAGES if name != CORE]


def _sources(distribution: str) -> set[str]:
    """The package files under src/, as paths inside a wheel (``forge_lm/cli/_main.py``)."""
    src = PACKAGES[distribution] / "src"
    found = {path.relative_to(src) for path in src.rglob("*") if path.is_file()}
    return {
        str(path)
        for path in found
        if "__pycache__" not in path.parts and not path.parts[0].endswith(".egg-info")  # build by-products
    }


def _entry_points(wheel) -> dict[str, dict[str, str]]:
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # entry-point names are case-sensitive
    parser.read_string(dist_info_file(wheel, "entry_points.txt"))
    return {section: dict(parser[section]) for section in parser.sections()}


def test_make_dist_builds_one_wheel_and_one_sdist_per_distribution(wheelhouse):
    expected = {wheel_of(wheelhouse, name).name for name in PACKAGES} | {
        sdist_of(wheelhouse, name).name for name in PACKAGES
    }
    assert {path.name for path in wheelhouse.iterdir()} == expected


@pytest.mark.parametrize("distribution", list(PACKAGES))
def test_wheel_metadata_matches_the_pyproject(wheelhouse, distribution):
    project = pyproject(distribution)
    metadata = wheel_metadata(wheel_of(wheelhouse, distribution))

    assert metadata["Name"] == distribution
    assert metadata["Version"] == project["version"]
    assert metadata["Summary"] == project["description"]
    assert metadata["License-Expression"] == "MIT"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert metadata["Requires-Python"] == ">=3.11"
    assert "Programming Language :: Python :: 3.11" in metadata.get_all("Classifier")
    declared = sorted(str(Requirement(line)) for line in project["dependencies"])
    built = sorted(str(Requirement(line)) for line in metadata.get_all("Requires-Dist") or [] if "extra ==" not in line)
    assert built == declared


@pytest.mark.parametrize("distribution", list(PACKAGES))
def test_readme_is_the_long_description_and_renders_as_markdown(wheelhouse, distribution):
    metadata = wheel_metadata(wheel_of(wheelhouse, distribution))
    readme = (PACKAGES[distribution] / "README.md").read_text()

    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata.get_payload().strip() == readme.strip()
    html = render(metadata.get_payload())  # PyPI's renderer: None when it cannot render
    assert html is not None
    assert re.search(rf"<h1[^>]*>{re.escape(distribution)}<", html)  # the title became a heading


@pytest.mark.parametrize("distribution", list(PACKAGES))
def test_wheel_and_sdist_ship_the_mit_license(wheelhouse, distribution):
    license_text = (REPO / "LICENSE").read_text()
    assert (PACKAGES[distribution] / "LICENSE").read_text() == license_text
    assert license_text.startswith("MIT License\n\nCopyright (c) 2026 The Forge authors\n")

    assert dist_info_file(wheel_of(wheelhouse, distribution), "licenses/LICENSE") == license_text
    sdist = sdist_of(wheelhouse, distribution)
    with tarfile.open(sdist) as archive:
        top = sdist.name.removesuffix(".tar.gz")
        assert archive.extractfile(f"{top}/LICENSE").read().decode() == license_text


@pytest.mark.parametrize("distribution", list(PACKAGES))
def test_wheel_holds_every_source_file_and_nothing_else(wheelhouse, distribution):
    with zipfile.ZipFile(wheel_of(wheelhouse, distribution)) as archive:
        names = archive.namelist()
    dist_info = {n for n in names if n.split("/")[0].endswith(".dist-info")}
    assert set(names) - dist_info == _sources(distribution)


@pytest.mark.parametrize("distribution", list(PACKAGES))
def test_sdist_holds_the_sources_readme_license_and_pyproject(wheelhouse, distribution):
    sdist = sdist_of(wheelhouse, distribution)
    top = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.removeprefix(f"{top}/") for name in archive.getnames()}
    assert {"LICENSE", "README.md", "pyproject.toml", "PKG-INFO"} <= names
    assert {f"src/{path}" for path in _sources(distribution)} <= names


def test_core_provides_the_forge_command_and_depends_on_no_plugin(wheelhouse):
    wheel = wheel_of(wheelhouse, CORE)
    assert _entry_points(wheel) == {"console_scripts": {"forge": "forge_lm.cli:run"}}
    required = {canonicalize_name(Requirement(line).name) for line in wheel_metadata(wheel).get_all("Requires-Dist")}
    assert "torch" in required
    assert not required & {canonicalize_name(name) for name in PLUGINS}


def test_core_extras_are_declared_for_the_optional_components(wheelhouse):
    metadata = wheel_metadata(wheel_of(wheelhouse, CORE))
    assert set(metadata.get_all("Provides-Extra")) == {"hf", "tensorboard", "plot", "s3"}


@pytest.mark.parametrize("distribution", PLUGINS)
def test_plugin_depends_on_a_compatible_range_of_the_core(wheelhouse, distribution):
    metadata = wheel_metadata(wheel_of(wheelhouse, distribution))
    requirements = [Requirement(line) for line in metadata.get_all("Requires-Dist")]
    (core,) = [r for r in requirements if canonicalize_name(r.name) == CORE]
    core_version = pyproject(CORE)["version"]
    major, minor = (int(part) for part in core_version.split(".")[:2])

    assert core.specifier.contains(core_version)  # installable beside this core ...
    assert not core.specifier.contains(f"{major}.{minor + 1}.0")  # ... and not beside the next, 0.x breaking release
    assert not core.specifier.contains(f"{major + 1}.0.0")


@pytest.mark.parametrize("distribution", PLUGINS)
def test_plugin_wheel_declares_its_forge_lm_entry_point(wheelhouse, distribution):
    wheel = wheel_of(wheelhouse, distribution)
    declared = pyproject(distribution)["entry-points"]["forge_lm"]

    assert _entry_points(wheel) == {"forge_lm": declared}
    with zipfile.ZipFile(wheel) as archive:
        for target in declared.values():
            module = target.partition(":")[0]
            assert f"{module.replace('.', '/')}.py" in archive.namelist()
