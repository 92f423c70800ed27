"""Fixtures of the distributed tests: one-process ``forge train`` runs shared by the tests that
compare with the same run (test_torchrun_cli.py and test_context_parallel.py train the same tiny
model for the same steps as their one-process reference, and the same 2 steps as a start to
resume from on other ranks)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from forge_lm.testing.distributed import torchrun


def _key(args: Sequence[str]) -> tuple[str, ...]:
    """Command lines that configure the same run: ``--section.key=value`` options in any order,
    each named once (where one is named twice, the order decides, and only the same order is
    the same run)."""
    names = [arg.partition("=")[0] for arg in args]
    if all(arg.startswith("--") for arg in args) and len(set(names)) == len(names):
        return tuple(sorted(args))
    return tuple(args)


class OneProcessRuns:
    """``forge train ARGS`` in a fresh interpreter, once per session for each distinct ``ARGS``
    (``--train.output_dir`` is the fixture's). :meth:`read` gives the run directory, which the
    tests only read; :meth:`copy` gives a copy of it to resume in."""

    def __init__(self, root: Callable[[], Path]) -> None:
        self._root = root
        self._runs: dict[tuple[str, ...], Path] = {}

    def read(self, *args: str) -> Path:
        key = _key(args)
        if key not in self._runs:
            run_dir = self._root() / "run"
            env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_LM_")}  # as every test starts
            result = subprocess.run(
                [sys.executable, "-m", "forge_lm", "train", *args, f"--train.output_dir={run_dir}"],
                capture_output=True,
                text=True,
                env=env,
                timeout=300,
                check=False,
            )
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            self._runs[key] = run_dir
        return self._runs[key]

    def copy(self, target: Path, *args: str) -> Path:
        """A copy of the run of ``args`` at ``target``, as if it had been trained there: its
        config names ``target`` as its output directory."""
        source = self.read(*args)
        shutil.copytree(source, target, symlinks=True)
        config = target / "config.toml"
        config.write_text(config.read_text().replace(str(source), str(target)))
        return target


@pytest.fixture(scope="session")
def one_process_runs(tmp_path_factory: pytest.TempPathFactory) -> OneProcessRuns:
    return OneProcessRuns(lambda: tmp_path_factory.mktemp("one-process"))


# A case: the worker's arguments for it, and the number of ranks it runs on.
Cases = dict[str, tuple[list[str], int]]


@pytest.fixture(scope="session")
def launches_by_rank_count(tmp_path_factory: pytest.TempPathFactory):
    """``launches_by_rank_count(worker, cases)``: a function ``launch(case) -> (the worker's
    results for case, the whole launch's output)``. The worker (``worker RESULT_PATH CASES_JSON``,
    rank 0 writing ``{case: results}``) runs under torchrun once per number of ranks, every case of
    that number in turn, the first time one of them is asked for: one launch instead of one per case."""

    def launches(worker: Path, cases: Cases, timeout: float = 600.0) -> Callable[[str], tuple[dict, str]]:
        launched: dict[int, tuple[dict, str]] = {}

        def launch(case: str) -> tuple[dict, str]:
            nproc = cases[case][1]
            if nproc not in launched:
                batch = {name: args for name, (args, ranks) in cases.items() if ranks == nproc}
                out = tmp_path_factory.mktemp(f"{nproc}-ranks") / "result.json"
                result = torchrun([str(worker), str(out), json.dumps(batch)], nproc=nproc, timeout=timeout)
                assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
                launched[nproc] = json.loads(out.read_text()), result.stdout + result.stderr
            results, output = launched[nproc]
            return results[case], output

        return launch

    return launches
