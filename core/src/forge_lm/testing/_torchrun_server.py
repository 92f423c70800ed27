"""A process that forks one ``torchrun`` per request, with torch imported once.

``python -m torch.distributed.run`` spends about 2.5 s of a 2-core machine importing torch
before it starts a rank; a test suite that launches a hundred runs pays that a hundred times.
This server imports :mod:`torch.distributed.run` once and, for each request, forks a child that
*is* that command: it takes the request's working directory, environment and argument list,
sends its output (and its ranks', which inherit it) to the request's files, and runs torchrun's
own ``main``. The ranks are new interpreters started by torchrun's agent as always; only the
agent's import is shared. :func:`forge_lm.testing.distributed.torchrun` starts one server per
process and talks to it.

Protocol, one JSON object per line: the client writes ``{"argv", "env", "cwd", "stdout",
"stderr"}`` on the server's stdin; the server answers ``{"pid": ...}`` when the child runs and
``{"pid": ..., "returncode": ...}`` when it has ended (negative: killed by that signal, as
:mod:`subprocess` reports it). End of input ends the server.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _child(request: dict[str, Any]) -> int:
    """In the forked child: become ``python -m torch.distributed.run *argv``; its exit code."""
    os.setpgid(0, 0)  # the agent and its ranks in a group of their own: a client's timeout ends them all
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["torchrun", *request["argv"]]
    from torch.distributed.run import main

    try:
        main(request["argv"])
    except SystemExit as done:  # argparse errors and torchrun's own failures end this way
        code = done.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException as error:  # noqa: BLE001 - what the command prints before exiting 1
        import traceback

        # From torchrun's main down, as the interpreter prints it: this module's frame left out.
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        return 1
    return 0


def _answer(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve() -> None:
    import torch.distributed.run  # noqa: F401 - the import every child shares

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(request)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _answer({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve()
