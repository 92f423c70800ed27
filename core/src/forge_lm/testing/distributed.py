"""Launch real multi-process runs for tests: ``torchrun`` on CPU with the gloo backend.

Used by Forge's own distributed tests and available to plugin authors::

    result = torchrun(["-m", "forge_lm", "train", "--distributed.dp_shard=2"], nproc=2)
    assert result.returncode == 0, result.stderr

Each launch is torchrun's own command, forked from a process that imported torch once
(:mod:`forge_lm.testing._torchrun_server`): a launch then costs the ranks' start, not also the
agent's 2.5 s import. ``FORGE_TESTING_TORCHRUN=exec`` runs ``python -m torch.distributed.run``
afresh each time instead.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


def torchrun(
    args: Sequence[str],
    nproc: int = 2,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 600.0,
) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc_per_node=nproc args...`` and wait for it.

    ``args`` is what follows torchrun's own options: a script path and its arguments, or
    ``-m module ...``. Each rank gets one intra-op thread (ranks share the machine's cores).
    Output is captured as text; the caller checks ``returncode``.
    """
    argv = ["--standalone", f"--nproc_per_node={nproc}", *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if os.environ.get("FORGE_TESTING_TORCHRUN") == "exec":
        command = [sys.executable, "-m", "torch.distributed.run", *argv]
        return subprocess.run(
            command, env=full_env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    return _SERVER.run(argv, full_env, cwd, timeout)


class _TorchrunServer:
    """The client of one :mod:`~forge_lm.testing._torchrun_server` per process, started at the
    first launch and ended with the process (its input closes). Launches through it are one at
    a time; a server that died is started again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._pending = b""  # what the server wrote after the last line read

    def run(
        self, argv: list[str], env: Mapping[str, str], cwd: str | Path | None, timeout: float
    ) -> subprocess.CompletedProcess:
        with self._lock, tempfile.TemporaryDirectory(prefix="forge-torchrun-") as scratch:
            out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
            # The caller's directory, as subprocess.run would use it: the server's may be another.
            cwd = os.path.abspath(cwd if cwd else os.getcwd())
            request = {"argv": argv, "env": dict(env), "cwd": cwd, "stdout": str(out), "stderr": str(err)}
            process = self._started()
            process.stdin.write(json.dumps(request).encode() + b"\n")
            process.stdin.flush()
            pid = self._answer(process, None)["pid"]
            try:
                returncode = self._answer(process, timeout)["returncode"]
            except subprocess.TimeoutExpired:
                self._stop(process, pid)
                raise subprocess.TimeoutExpired(["torchrun", *argv], timeout, _text(out), _text(err)) from None
            return subprocess.CompletedProcess(["torchrun", *argv], returncode, _text(out), _text(err))

    def _stop(self, process: subprocess.Popen, pid: int) -> None:
        """End a launch that ran out of time: SIGTERM first, on which torchrun's agent stops its
        ranks (each in a session of its own, which a SIGKILL of the agent would leave running),
        then SIGKILL after 30 s."""
        os.killpg(pid, signal.SIGTERM)
        try:
            self._answer(process, 30.0)
        except subprocess.TimeoutExpired:
            os.killpg(pid, signal.SIGKILL)
            self._answer(process, None)

    def _started(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "forge_lm.testing._torchrun_server"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,  # bytes, read from the descriptor (_answer)
            )
            self._pending = b""
            atexit.register(self._process.stdin.close)
        return self._process

    def _answer(self, process: subprocess.Popen, timeout: float | None) -> dict:
        """The server's next line; TimeoutExpired after ``timeout`` seconds without one. Read
        from the descriptor itself, so that a line already read is never waited for."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([process.stdout.fileno()], [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired("torchrun", timeout or 0.0)
            chunk = os.read(process.stdout.fileno(), 65536)
            if not chunk:
                self._process = None
                raise RuntimeError(f"forge's torchrun server ended (exit code {process.wait()})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


_SERVER = _TorchrunServer()


def metrics_by_step(run_dir: str | Path) -> dict[int, dict[str, float]]:
    """The run's ``metrics.jsonl`` as ``{step: metrics}``, the records of one step merged and
    the newest winning: a resumed run logs a step again, and evaluations log apart from
    training. What multi-process tests compare against the one-process run."""
    from forge_lm.metrics.jsonl import read_metrics

    steps: dict[int, dict[str, float]] = {}
    for record in read_metrics(Path(run_dir) / "metrics.jsonl"):
        steps.setdefault(record["step"], {}).update(record)
    return steps
