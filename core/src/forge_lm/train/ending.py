"""How a run ends: the calls every run makes on its way out, and the stop after a plugin failed.

:func:`end_run` runs from the loop's ``finally``: ``train_end``, the metrics backends' finish
and the checkpoint writer's close, none of which may replace the exception that ended the run.
:class:`Teardown` runs last, from :func:`~forge_lm.train.loop.train`'s ``finally``: the barrier,
the pipeline's release and the process group's destruction, in that order, exactly once.
:func:`stop_for_plugin` decides, after a plugin's training hook raised, whether the last step
is checkpointed first, and says what is intact (the policy is in :mod:`forge_lm.hookspecs`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from forge_lm.checkpoint import CheckpointManager
from forge_lm.distributed import ParallelDims
from forge_lm.distributed.launch import shutdown_distributed
from forge_lm.distributed.pipeline import PipelineRunner
from forge_lm.errors import ForgeError
from forge_lm.notices import warn
from forge_lm.plugins import PluginManager, PluginStatus
from forge_lm.plugins._calls import PluginHookFailed, describe
from forge_lm.train.watchdog import HANG_EXIT_CODE, HangWatchdog

_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER_LOST = re.compile(r"connection closed by peer|connection reset by peer|broken pipe", re.IGNORECASE)


def _collective_error(error: BaseException) -> RuntimeError | None:
    """The error of a collective in ``error`` or its causes: ``error`` itself when it is a
    RuntimeError (as before guards wrapped errors), or up to a few levels down (``raise ...
    from``) a torch.distributed error or gloo's RuntimeError, never a plugin's own."""
    if isinstance(error, RuntimeError):
        return error
    for _ in range(4):
        error = error.__cause__
        if error is None:
            return None
        if isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "gloo" in str(error).lower()):
            return error
    return None


def _clipped(line: str) -> str:
    """gloo's first line, without its trailing advice and emoji."""
    return line.split(". This is typically caused", 1)[0]


class CollectiveTimedOut(ForgeError):
    """A collective waited longer than ``[distributed] timeout`` for the other ranks. It ends
    the run with the hang watchdog's exit code: to a job script both mean a stuck run."""

    exit_code = HANG_EXIT_CODE


def collective_timeout(error: BaseException, timeout: float) -> CollectiveTimedOut | None:
    """``error`` explained, if it is a collective of this run's process group timing out (gloo
    raises a RuntimeError "Timed out waiting ...", NCCL a DistBackendError, a subclass) or losing
    its connection to a rank that died (gloo's "Connection closed by peer"). The collective's
    error may be the cause of another (a guard naming the model it was raised in)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    found = _collective_error(error)
    if found is None:
        return None
    first_line = str(found).strip().splitlines()[0] if str(found).strip() else ""
    if _PEER_LOST.search(first_line):
        return CollectiveTimedOut(
            f"the connection to another rank of the run closed ({_clipped(first_line)}): that rank stopped (killed, "
            "out of memory, its node lost). Look at its output for why. Exiting with "
            f"{HANG_EXIT_CODE}; the checkpoints written before are intact: run the same command to resume."
        )
    if not _TIMED_OUT.search(first_line):
        return None
    return CollectiveTimedOut(
        f"a collective operation waited longer than [distributed] timeout = {timeout:g} s for the other ranks "
        f"({first_line}). Another rank stopped, hung or is far slower: look at its output (and <run>/hang/ for "
        "stacks, when resilience.hang_timeout fired there). If a step can take this long (a first compile, a "
        f"large checkpoint), raise [distributed] timeout. Exiting with {HANG_EXIT_CODE}; the newest checkpoint "
        "is intact."
    )


def end_run(
    manager: PluginManager,
    context: Any,
    status: str,
    started: bool,
    backends: list[Any],
    checkpoints: CheckpointManager,
    summary: dict[str, float],
) -> None:
    """train_end, the backends' finish and the checkpoint writer's close. A failure in any of
    them is a warning: the run's outcome (and its exception, if any) stands. Only Ctrl-C
    during train_end after a completed run still interrupts."""
    interrupted: KeyboardInterrupt | None = None
    if started:
        try:
            manager.call_quietly("forge_lm_train_end", context=context, status=status)
        except KeyboardInterrupt as exc:
            interrupted = exc
    for backend in backends:  # guarded: a failure is a warning
        backend.finish(summary)
    try:
        checkpoints.close()
    except Exception as exc:
        if status == "completed":
            raise
        warn(f"the checkpoint being written in the background did not finish: {describe(exc)}")
    if interrupted is not None and status == "completed":
        raise interrupted


class Teardown:
    """The end of this process's part in a run, in one fixed order, whatever ended it.

    By the time :meth:`close` runs, the run's background work has finished in the loop: the
    data loader's read-ahead thread was closed, :func:`end_run` closed the checkpoint writer
    (joining a save still being written) and finished the metrics backends, and the preemption
    watcher and the profiler were stopped by their ``with`` blocks. No thread of the run is left
    to use the process group while it goes; the hang watchdog (handed over by :meth:`watch`)
    only watches, until the end. Then
    (:func:`~forge_lm.distributed.launch.shutdown_distributed`):

    1. a barrier, when every rank stops together (``together``: a completed run, a preemption,
       a non-finite loss); not when this rank alone failed, which would wait for ranks that
       never come;
    2. the release of what :meth:`hold` was given (the pipeline's schedules and stages);
    3. the destruction of the process group.

    :meth:`close` acts once; a second call does nothing.
    """

    def __init__(self) -> None:
        self._releases: list[Callable[[], None]] = []
        self._watchdog: HangWatchdog | None = None
        self.closed = False

    def watch(self, watchdog: HangWatchdog) -> HangWatchdog:
        """Start ``watchdog``; it watches the rest of the run, this teardown included, and is
        stopped last by :meth:`close`."""
        self._watchdog = watchdog.start()
        return watchdog

    def hold(self, pipeline: PipelineRunner | None) -> None:
        """Release ``pipeline`` (when there is one) before the process group is destroyed."""
        if pipeline is not None:
            self._releases.append(pipeline.close)

    def close(self, *, together: bool) -> None:
        if self.closed:
            return
        self.closed = True
        watchdog, self._watchdog = self._watchdog, None
        try:
            if watchdog is not None:  # a barrier waiting for a rank that never comes is a hang too
                watchdog.doing("the process group's teardown (its barrier, the pipeline's release)")
            shutdown_distributed(wait_for_all=together, release=self._release)
        finally:
            if watchdog is not None:
                watchdog.stop()

    def _release(self) -> None:
        releases, self._releases = self._releases, []
        for release in releases:
            release()


def stop_for_plugin(
    failure: PluginHookFailed,
    checkpoints: CheckpointManager,
    step: int,
    dims: ParallelDims,
    save: Callable[[], None],
) -> str:
    """After a plugin's training hook or component failed at ``step`` (the last completed one):
    checkpoint it (``save()``) unless it is saved already, the failure was in saving or loading
    plugin state, or the failure says the state may be half-changed (``failure.unsaved``: an
    optimizer's or a scheduler's step; then the checkpoint that exists is the one to trust); say
    where the run stopped and what is intact. Across ranks no checkpoint is attempted: the other
    ranks are not in step with this one."""
    note = ""
    try:
        saved = {int(path.name[5:]) for path in checkpoints.complete()}
    except OSError:  # the run directory cannot be read: do not write into it either
        saved = {step}
    wanted = failure.hook not in ("forge_lm_save_state", "forge_lm_load_state")
    unsaved = getattr(failure, "unsaved", None)  # a component that failed half-way through changing the state
    if unsaved is not None:
        wanted, note = False, f" and saved nothing ({unsaved})"
    if wanted and step > 0 and step not in saved and not dims.distributed:
        try:
            save()
            checkpoints.wait()
            return f"Training stopped at step {step} after saving a checkpoint of that step, which is intact"
        except Exception as exc:  # noqa: BLE001 - the plugin's failure stays the error reported
            cause = exc.headline if isinstance(exc, PluginHookFailed) else describe(exc)
            note = f"; saving a checkpoint of that step failed too ({cause})"
    try:
        newest = checkpoints.latest()
    except OSError:
        newest = None
    intact = f"the newest checkpoint ({newest.name}) is intact" if newest else "no checkpoint was written yet"
    return f"Training stopped at step {step}{note}; {intact}"


def warn_about_unused_plugins(manager: PluginManager) -> None:
    """One line per installed plugin this run goes without because it is broken or incompatible."""
    for plugin in manager.plugins:
        if plugin.status in (PluginStatus.BROKEN, PluginStatus.INCOMPATIBLE):
            warn(f"{plugin.label} is {plugin.status} and not used by this run: {plugin.reason}")
