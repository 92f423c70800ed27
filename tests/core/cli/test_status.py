"""Issue 36: `forge generate`, `config validate` and `doctor` printed nothing for seconds
(44 s for a first generate). On a terminal a transient status line names the slow step; off a
terminal nothing is added, so output that scripts and tests parse is unchanged."""

from __future__ import annotations

import io

from forge_lm.cli._status import working


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_sees_the_slow_step_named_while_it_runs():
    screen = Terminal()
    with working("loading torch and the model of runs/default", stream=screen):
        pass
    drawn = screen.getvalue()
    assert "loading torch and the model of runs/default" in drawn
    assert drawn.endswith("\x1b[2K")  # and erased when the step ended: the command's output stays alone


def test_a_pipe_or_a_log_file_gets_nothing():
    log = io.StringIO()
    with working("loading torch", stream=log):
        pass
    assert log.getvalue() == ""
