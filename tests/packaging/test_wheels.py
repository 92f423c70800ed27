"""Capability arrives with ``pip install forge-moe`` and leaves with ``pip uninstall forge-moe``.

A fresh virtual environment, outside this repository's development set-up, gets the wheels
that ``make dist`` built, through pip and nothing else (``--no-index --find-links``): first
the core alone, then each plugin in turn, installed, used for a short training, uninstalled.
Every step is a real subprocess: pip, and the ``forge`` console script the wheel installed.

To stay offline and fast, the third-party packages the wheels declare (torch, numpy, wandb,
and what they need) are not installed again: the ``reused_site`` directory of symlinks to the
development environment's copies is added to the fresh environment by a ``.pth`` file, so
pip sees them as installed. forge-lm and the plugins are never among them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from .conftest import PACKAGES, REPO

TINY = (
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.max_seq_len=64",
    "--train.batch_size=4",
    "--train.seq_len=16",
    "--train.max_steps=3",
    "--metrics.log_interval=1",
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
)
SYNTHETIC = (*TINY, "--data.name=synthetic")
LM_EVAL_TASKS = REPO / "tests" / "plugins" / "forge_lm_eval" / "tasks"  # local lm-eval tasks: nothing to download
BUILTIN_PLUGINS = {
    "core.optimizers",
    "core.schedulers",
    "core.losses",
    "core.datasets",
    "core.metrics",
    "core.tokenizers",
    "core.models",
    "core.feed_forwards",
    "core.transforms",
    "core.hf_llama",
}


class Venv:
    """A fresh virtual environment and the commands a user runs in it."""

    def __init__(self, root: Path, wheelhouse: Path) -> None:
        self.root = root
        self.wheelhouse = wheelhouse
        self.python = root / "bin" / "python"
        home = root.parent / "home"  # a user's own home: W&B's settings and caches, pip's cache
        home.mkdir(exist_ok=True)
        skip = ("FORGE_LM_", "PIP_", "WANDB_", "XDG_", "PYTHON", "VIRTUAL_ENV")
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(skip)},
            "HOME": str(home),
            "PATH": f"{root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "VIRTUAL_ENV": str(root),
            "PIP_NO_INDEX": "1",  # never the network, whatever a step asks for
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_INPUT": "1",
            "HF_HUB_OFFLINE": "1",  # lm-eval and datasets: local tasks only, nothing from the Hub
            "HF_DATASETS_OFFLINE": "1",
        }

    def run(self, *argv: str | Path, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(a) for a in argv], capture_output=True, text=True, env=self.env, cwd=cwd, timeout=timeout
        )

    def pip(self, *args: str | Path) -> str:
        done = self.run(self.python, "-m", "pip", *args)
        assert done.returncode == 0, f"pip {' '.join(map(str, args))}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def install(self, *requirements: str | Path) -> None:
        self.pip("install", "--no-index", "--find-links", self.wheelhouse, *requirements)

    def uninstall(self, *distributions: str) -> None:
        self.pip("uninstall", "--yes", *distributions)

    def installed(self) -> set[str]:
        return {p["name"] for p in json.loads(self.pip("list", "--format=json"))}

    def forge(self, *args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return self.run(self.root / "bin" / "forge", *args, cwd=cwd)

    def plugins(self) -> dict[str, dict]:
        done = self.forge("list-plugins", "--json")
        assert done.returncode == 0, done.stderr
        return {p["name"]: p for p in json.loads(done.stdout)["plugins"]}


@pytest.fixture(scope="module")
def venv(wheelhouse, reused_site, tmp_path_factory) -> Venv:
    """A new virtual environment with the core installed from its wheel, and nothing else of Forge."""
    root = tmp_path_factory.mktemp("user") / "venv"
    done = subprocess.run([sys.executable, "-m", "venv", str(root)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    env = Venv(root, wheelhouse)
    site = env.run(env.python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()
    (Path(site) / "_forge_tests_reused_site.pth").write_text(f"{reused_site}\n")
    # The venv's bundled setuptools is older than torch requires; online, pip would upgrade it
    # from PyPI. Offline, the reused (newer) one takes its place.
    env.uninstall("setuptools")
    assert env.run(env.python, "-c", "import forge_lm").returncode != 0  # nothing of Forge yet
    env.install("forge-lm")
    return env


@attrs.frozen
class PluginCase:
    distribution: str
    plugin: str
    components: dict[str, set[str]]  # at least these, by category
    train_args: tuple[str, ...]  # a training that needs the plugin
    missing: tuple[str, ...]  # what `forge train` says without it
    cwd: Path | None = None  # where `forge train` runs; unset: the test's temporary directory


CASES = [
    PluginCase(
        "forge-moe",
        "moe",
        {"feed_forwards": {"moe"}, "routers": {"softmax_topk", "sigmoid_topk"}},
        (str(REPO / "configs" / "moe_debug.toml"), *SYNTHETIC, "--model.ffn.n_experts=4"),
        ("[model.ffn] name = 'moe': unknown feed-forward layer 'moe'.", "pip install forge-moe"),
    ),
    PluginCase(
        "forge-optim-muon",
        "muon",
        {"optimizers": {"muon"}},
        (*SYNTHETIC, "--optimizer.name=muon"),
        ("[optimizer] name = 'muon': unknown optimizer 'muon'.", "pip install forge-optim-muon"),
    ),
    PluginCase(
        "forge-wandb",
        "wandb",
        {"metrics_backends": {"wandb"}},
        (*SYNTHETIC, '--metrics.backends=["jsonl", "wandb"]', "--metrics.wandb.mode=offline"),
        ("unknown metrics backend 'wandb'.", "pip install forge-wandb"),
    ),
    PluginCase(
        "forge-prometheus",
        "prometheus",
        {"metrics_backends": {"prometheus"}},
        (*SYNTHETIC, '--metrics.backends=["jsonl", "prometheus"]', "--metrics.prometheus.port=0"),
        ("unknown metrics backend 'prometheus'.", "pip install forge-prometheus"),
    ),
    PluginCase(
        "forge-lm-eval",
        "lm_eval",
        {"evaluators": {"lm_eval"}},
        (
            *SYNTHETIC,
            "--eval.interval=3",
            "--eval.steps=1",
            '--eval.evaluators=["lm_eval"]',
            '--eval.lm_eval.tasks=["choice.yaml", "complete.yaml"]',
            "--eval.lm_eval.limit=2",
        ),
        ("unknown evaluator 'lm_eval'.", "pip install forge-lm-eval"),
        cwd=LM_EVAL_TASKS,  # the tasks' data files are named relative to it
    ),
    PluginCase(
        "forge-float8",
        "float8",
        {"model_transforms": {"float8"}},
        (str(REPO / "configs" / "float8_debug.toml"), *SYNTHETIC),
        ("[transforms.float8]: unknown model transform 'float8'.", "pip install forge-float8"),
    ),
]


def test_core_wheel_alone_lists_only_the_builtins_and_trains_a_dense_model(venv, tmp_path):
    where = venv.run(venv.python, "-c", "import forge_lm; print(forge_lm.__file__)").stdout.strip()
    assert Path(where).is_relative_to(venv.root)  # the installed wheel, not this repository's sources
    assert venv.installed() & set(PACKAGES) == {"forge-lm"}

    plugins = venv.plugins()
    assert set(plugins) == BUILTIN_PLUGINS
    assert all((p["distribution"], p["status"], p["builtin"]) == ("forge-lm", "ok", True) for p in plugins.values())

    run_dir = tmp_path / "dense"
    done = venv.forge("train", *TINY, f"--train.output_dir={run_dir}", cwd=tmp_path)  # the default data
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(f"run directory {run_dir}")
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    assert _ran_with(run_dir) == {"forge-lm"}


def test_doctor_finds_the_wheel_installed_core_ready_to_train(venv, tmp_path):
    done = venv.forge("doctor", "--json", "--run-dir", tmp_path / "run", cwd=tmp_path)

    assert done.returncode == 0, done.stdout + done.stderr
    checks = {row["check"]: row for row in json.loads(done.stdout)["checks"]}
    assert checks["dependencies"]["status"] == "ok"  # everything forge-lm declares is there
    assert checks["plugins"]["detail"] == "no third-party plugin installed"
    assert not [row for row in checks.values() if row["status"] == "fail"]


def _ran_with(run_dir: Path) -> set[str]:
    """The distributions the run's plugins.json names."""
    return {entry["distribution"] for entry in json.loads((run_dir / "plugins.json").read_text())}


@pytest.mark.parametrize("case", CASES, ids=[case.distribution for case in CASES])
def test_plugin_arrives_with_pip_install_and_leaves_with_pip_uninstall(venv, tmp_path, case):
    cwd = case.cwd or tmp_path
    before = venv.forge("train", *case.train_args, f"--train.output_dir={tmp_path / 'before'}", cwd=cwd)
    assert before.returncode == 2
    for text in case.missing:
        assert text in before.stderr

    venv.install(case.distribution)
    try:
        plugin = venv.plugins()[case.plugin]
        assert (plugin["distribution"], plugin["version"], plugin["status"]) == (case.distribution, "0.1.0", "ok")
        for category, names in case.components.items():
            assert names <= set(plugin["components"][category])

        run_dir = tmp_path / "with"
        done = venv.forge("train", *case.train_args, f"--train.output_dir={run_dir}", cwd=cwd)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().endswith(f"run directory {run_dir}")
        assert _ran_with(run_dir) == {"forge-lm", case.distribution}
        if case.plugin == "wandb":
            assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))  # W&B wrote its offline run
    finally:
        venv.uninstall(case.distribution)

    assert case.distribution not in venv.installed()
    assert set(venv.plugins()) == BUILTIN_PLUGINS
    after = venv.forge("train", *case.train_args, f"--train.output_dir={tmp_path / 'after'}", cwd=cwd)
    assert after.returncode == 2
    assert after.stderr == before.stderr  # the same clear message as before it was ever installed
    assert not (tmp_path / "after").exists()


def test_requirements_lines_rebuild_the_plugins_after_they_are_wiped(venv, tmp_path):
    venv.install("forge-moe", "forge-optim-muon")
    try:
        done = venv.forge("list-plugins", "--requirements")
        assert done.returncode == 0, done.stderr
        assert done.stdout == "forge-lm==0.1.0\nforge-moe==0.1.0\nforge-optim-muon==0.1.0\n"
        requirements = tmp_path / "requirements.txt"
        requirements.write_text(done.stdout)

        venv.uninstall("forge-moe", "forge-optim-muon")  # what an upgrade that replaced the environment leaves
        assert set(venv.plugins()) == BUILTIN_PLUGINS

        venv.install("-r", requirements)
        plugins = venv.plugins()
        assert {name: plugins[name]["status"] for name in ("moe", "muon")} == {"moe": "ok", "muon": "ok"}
    finally:
        venv.uninstall("forge-moe", "forge-optim-muon")


def test_installing_a_plugin_alone_brings_in_the_core_it_requires(venv):
    venv.uninstall("forge-lm")
    try:
        assert not venv.installed() & set(PACKAGES)
        venv.install("forge-optim-muon")
        assert venv.installed() & set(PACKAGES) == {"forge-lm", "forge-optim-muon"}
        assert venv.plugins()["muon"]["status"] == "ok"
    finally:
        venv.pip("uninstall", "--yes", "forge-optim-muon")
        venv.install("forge-lm")
