"""forge_lm.api, the plugin-facing API: each name is the core's own object, found on first use
(importing the module loads no torch), and the first-party plugins take nothing else from the
core's internals."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import forge_lm
import forge_lm.api as api

REPO = Path(__file__).resolve().parents[2]
PUBLIC = ("forge_lm.api", "forge_lm.components", "forge_lm.errors", "forge_lm.hookspecs", "forge_lm.testing")
PUBLIC += ("forge_lm.validators",)


@pytest.mark.parametrize("name", sorted(api._EXPORTS))
def test_each_name_is_the_core_object_it_stands_for(name):
    module, attribute = api._EXPORTS[name]
    assert getattr(api, name) is getattr(importlib.import_module(module), attribute)
    assert name in api.__all__
    assert name in dir(api)


def test_the_api_carries_the_plugin_api_version_list_plugins_checks():
    assert api.PLUGIN_API_VERSION == forge_lm.PLUGIN_API_VERSION
    assert "PLUGIN_API_VERSION" in api.__all__


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match=r"forge_lm\.api' has no attribute 'matmul_tn'"):
        api.matmul_tn  # noqa: B018
    with pytest.raises(ImportError, match="matmul_tn"):
        exec("from forge_lm.api import matmul_tn", {})


def test_a_patched_core_function_is_what_a_later_import_gets(monkeypatch):
    """Nothing is cached in the API module: a plugin importing inside a function sees a patch."""
    import forge_lm.hardware as hardware

    monkeypatch.setattr(hardware, "cpu_multiplies_bf16", lambda: "patched")
    from forge_lm.api import cpu_multiplies_bf16

    assert cpu_multiplies_bf16() == "patched"


def test_importing_the_api_loads_no_torch():
    code = "import sys, forge_lm.api; assert 'torch' not in sys.modules, 'torch loaded'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def _internal_imports(source: Path, root: Path = REPO) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module] if node.module != "forge_lm" else [f"forge_lm.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            if module == "forge_lm.hookimpl" or not module.startswith("forge_lm."):
                continue
            if not any(module == public or module.startswith(public + ".") for public in PUBLIC):
                found.append(f"{source.relative_to(root)}:{node.lineno}: {module}")
    return found


FIRST_PARTY = sorted(path.name for path in (REPO / "plugins").iterdir() if (path / "src").is_dir())


@pytest.mark.parametrize("plugin", FIRST_PARTY)
def test_first_party_plugins_import_only_the_public_modules(plugin):
    sources = sorted((REPO / "plugins" / plugin / "src").rglob("*.py"))
    assert sources
    assert [line for source in sources for line in _internal_imports(source)] == []


def test_the_example_plugin_imports_only_the_public_modules():
    sources = sorted((REPO / "examples").rglob("*.py"))
    assert sources
    assert [line for source in sources for line in _internal_imports(source)] == []


def test_the_check_finds_an_internal_import(tmp_path):
    """The plugin checks above can fail: a module importing forge_lm.model.linear is named."""
    source = tmp_path / "plugin.py"
    source.write_text("from forge_lm.model.linear import Linear\nfrom forge_lm import events, hookimpl\n")
    assert _internal_imports(source, tmp_path) == ["plugin.py:1: forge_lm.model.linear", "plugin.py:2: forge_lm.events"]


def test_the_import_contract_forbids_every_core_module_but_the_public_ones():
    """pyproject.toml's import-linter contract lists the forbidden modules by name: a module added
    to the core is forbidden to plugins unless it is made public here and there."""
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"] == "Plugins import only forge_lm's public modules"]
    package = Path(forge_lm.__file__).parent
    submodules = {f"forge_lm.{path.stem}" for path in package.glob("*.py") if path.stem != "__init__"}
    submodules |= {f"forge_lm.{path.parent.name}" for path in package.glob("*/__init__.py")}
    assert set(contract["forbidden_modules"]) == submodules - set(PUBLIC)
    plugins = {name.replace("-", "_") for name in FIRST_PARTY}
    assert set(contract["source_modules"]) == plugins | {"forge_example_plugin"}


def test_what_type_checkers_see_is_what_the_api_exports():
    """The TYPE_CHECKING imports at the end of api.py (for editors) name the same objects."""
    tree = ast.parse(Path(api.__file__).read_text())
    (block,) = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    seen = {
        alias.asname or alias.name: (node.module, alias.name)
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert seen == api._EXPORTS
