"""forge_lm.testing.distributed.torchrun: a launch forked from the server that imported torch
once gives what ``python -m torch.distributed.run`` run afresh gives (output, exit code, the
environment and directory it was given), ends every rank when it runs out of time, and a
server that died is started again."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from forge_lm.testing import distributed
from forge_lm.testing.distributed import torchrun

REPORT = textwrap.dedent(
    """
    import os, sys
    rank = int(os.environ["RANK"])
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} in {os.getcwd()} with {os.environ.get('FORGE_PROBE')}")
    print(f"rank {rank} threads {os.environ['OMP_NUM_THREADS']}", file=sys.stderr)
    sys.exit(int(sys.argv[1]) if rank == 1 else 0)
    """
)


def _both(monkeypatch: pytest.MonkeyPatch, *args, **kwargs) -> tuple[subprocess.CompletedProcess, ...]:
    """The same launch forked from the server and run afresh."""
    forked = torchrun(*args, **kwargs)
    monkeypatch.setenv("FORGE_TESTING_TORCHRUN", "exec")
    fresh = torchrun(*args, **kwargs)
    monkeypatch.delenv("FORGE_TESTING_TORCHRUN")
    return forked, fresh


def _rank_lines(text: str) -> list[str]:
    return sorted(line for line in text.splitlines() if line.startswith("rank "))


def test_a_forked_launch_gives_what_a_fresh_torchrun_gives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    work = tmp_path / "work"
    work.mkdir()
    for code in (0, 3):
        forked, fresh = _both(monkeypatch, [str(script), str(code)], env={"FORGE_PROBE": "seen"}, cwd=work)
        assert forked.returncode == fresh.returncode == (0 if code == 0 else 1), forked.stderr
        assert (
            _rank_lines(forked.stdout)
            == _rank_lines(fresh.stdout)
            == [
                f"rank 0 of 2 in {work} with seen",
                f"rank 1 of 2 in {work} with seen",
            ]
        )
        assert _rank_lines(forked.stderr) == _rank_lines(fresh.stderr) == ["rank 0 threads 1", "rank 1 threads 1"]
        if code:  # torchrun's own report of the failed rank, in both
            assert "exitcode  : 3" in forked.stderr
            assert "exitcode  : 3" in fresh.stderr
            assert "forge_lm" not in forked.stderr  # the server's own frames are not in torchrun's traceback


def test_a_launch_runs_where_the_caller_is_now(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``cwd``, the caller's working directory at the call, not the server's."""
    (tmp_path / "here.py").write_text("import os\nprint(os.getcwd())\n")
    torchrun([str(tmp_path / "here.py")], nproc=1)  # the server runs before the directory changes
    monkeypatch.chdir(tmp_path)
    assert torchrun(["here.py"], nproc=1).stdout == f"{tmp_path}\n"


def test_a_launch_out_of_time_ends_its_ranks_and_the_next_launch_runs(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "sleep.py"
    script.write_text(
        f"import os, pathlib, time\npathlib.Path({str(pids)!r}, str(os.getpid())).touch()\ntime.sleep(120)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        torchrun([str(script)], timeout=8)
    ranks = [int(path.name) for path in pids.iterdir()]
    assert len(ranks) == 2  # both started before the time ran out
    for _ in range(100):  # torchrun's agent stops them on its SIGTERM
        if not any(_alive(pid) for pid in ranks):
            break
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in ranks)
    script.write_text("print('again')\n")
    assert torchrun([str(script)]).stdout.splitlines() == ["again", "again"]


def test_a_server_that_died_is_started_again(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    assert torchrun([str(script)], nproc=1).returncode == 0
    server = distributed._SERVER._process
    server.send_signal(signal.SIGKILL)
    server.wait()
    result = torchrun([str(script)], nproc=1)
    assert (result.returncode, result.stdout) == (0, "hello\n")
    assert distributed._SERVER._process.pid != server.pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"  # a zombie has ended
