"""Fixtures for forge-lm-eval: offline lm-eval, the local tasks, tiny runs and their exports.

Nothing here may reach the network: the Hugging Face libraries are put in offline mode (for this
process and for the commands tests start), their caches point into the test's temporary
directory, and any connection this process attempts to a host that is not local fails the test
(lm-eval's Hugging Face backend asks the Hub for a model's revision and ignores the failure; in
offline mode it does not ask).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from forge_lm.cli._main import main
from forge_lm.config import load_config
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.train import train

TASKS = Path(__file__).resolve().parent / "tasks"
CHOICE, COMPLETE, ROLLING = (str(TASKS / f"{name}.yaml") for name in ("choice", "complete", "rolling"))
ALL_TASKS = [CHOICE, COMPLETE, ROLLING]

# A tiny model whose max_seq_len (64) is shorter than some task texts: truncation and rolling
# windows are exercised. init_std 0.3 makes an untrained model's greedy output vary with its
# context (a small init makes every prompt continue with the same byte).
TINY = (
    *TINY_MODEL,
    "--model.init_std=0.3",
    "--train.batch_size=4",
    "--train.seq_len=16",
    "--train.max_steps=2",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--checkpoint.interval=0",
    "--data.name=python_stdlib",
)
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="session", autouse=True)
def _offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The Hugging Face libraries offline and cached in a temporary directory, in this process
    (their settings are read at import, so the modules' own values are set too) and in every
    process a test starts (through the environment)."""
    import datasets.config
    import huggingface_hub.constants

    cache = tmp_path_factory.mktemp("hf-cache")
    saved_env = {name: os.environ.get(name) for name in [*OFFLINE, "HF_DATASETS_CACHE", "HF_HOME"]}
    os.environ.update({**OFFLINE, "HF_DATASETS_CACHE": str(cache / "datasets"), "HF_HOME": str(cache)})
    saved = (huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
    saved_cache = datasets.config.HF_DATASETS_CACHE
    huggingface_hub.constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    datasets.config.HF_DATASETS_CACHE = cache / "datasets"
    yield
    huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved
    datasets.config.HF_DATASETS_CACHE = saved_cache
    for name, value in saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Fail the test if this process tries to connect anywhere but the local machine (even when
    the caller would swallow the error)."""
    attempts: list[str] = []
    real_connect = socket.socket.connect

    def connect(self: socket.socket, address: object) -> object:
        host = address[0] if isinstance(address, tuple) else address
        if self.family in (socket.AF_INET, socket.AF_INET6) and host not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(str(address))
            raise OSError(f"test: no network ({address})")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    yield attempts
    assert attempts == [], f"the test tried to reach the network: {attempts}"


@pytest.fixture
def in_tasks_dir(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Work in the tasks' directory: their data_files paths are relative to it."""
    monkeypatch.chdir(TASKS)
    return TASKS


@pytest.fixture(scope="session")
def hf_tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer.json (forge train-tokenizer) trained on the tasks' data."""
    from forge_lm.tokenizers.training import train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    sources = sorted(str(path) for path in (TASKS / "data").glob("*.jsonl"))
    return train_tokenizer(sources, out, vocab_size=320, min_frequency=1, format="text").path


@pytest.fixture(scope="session")
def make_run(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer_file: Path) -> Callable[[str], Path]:
    """``make_run(tokenizer)``: a tiny run trained for two steps with the ``bytes`` or ``hf``
    tokenizer (made once per session)."""
    runs: dict[str, Path] = {}

    def make(tokenizer: str) -> Path:
        if tokenizer not in runs:
            run_dir = tmp_path_factory.mktemp(f"run-{tokenizer}") / "run"
            choice = ["--tokenizer.name=bytes"]
            if tokenizer == "hf":
                choice = ["--tokenizer.name=hf", f"--tokenizer.path={hf_tokenizer_file}"]
            manager = PluginManager(PluginSettings(autoload=False))
            train(load_config(None, [*TINY, *choice, f"--train.output_dir={run_dir}"], manager.registry), manager)
            runs[tokenizer] = run_dir
        return runs[tokenizer]

    return make


@pytest.fixture(scope="session")
def export(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], Path]:
    """``export(run)``: ``forge export-hf`` of a run (made once per run)."""
    exported: dict[Path, Path] = {}

    def make(run_dir: Path) -> Path:
        if run_dir not in exported:
            out = tmp_path_factory.mktemp("hf") / "model"
            assert main(["--no-plugin-autoload", "export-hf", str(run_dir), str(out)]) == 0
            exported[run_dir] = out
        return exported[run_dir]

    return make
