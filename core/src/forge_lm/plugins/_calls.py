"""Calling plugins' hooks one implementation at a time, so that a failure names its plugin.

pluggy calls every implementation of a hook in one go, and an exception escaping one of them
says nothing about which plugin it came from. Every lifecycle and interoperability hook
call goes through :func:`call_each` instead: it calls the implementations one by one, in
pluggy's own order, and turns an exception into a :class:`PluginHookFailed` naming the
plugin (name, distribution, version) and the hook. Plugin return values are untrusted:
:func:`checked_metrics` and :func:`checkpoint_problem` say what is wrong with them.

The policy each failure gets (stop with exit 4, warn, ignore) is documented in
:mod:`forge_lm.hookspecs`.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import signal
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

from forge_lm.errors import ForgeError
from forge_lm.notices import warn  # noqa: F401 - the plugin manager warns through it
from forge_lm.plain_data import find_not_plain, short_repr
from forge_lm.plugins._model import PluginInfo

PLUGIN_HOOK_EXIT_CODE = 4
"""Exit code of ``forge train`` when a plugin's training hook failed (see hookspecs)."""


class PluginHookFailed(ForgeError):
    """A plugin's hook implementation raised, or returned something that cannot be used.

    ``str()`` is the whole message: the plugin and hook, what went wrong, then either
    :attr:`outcome` (set by the training loop: where the run stopped and which checkpoint is
    intact) with how to resume, or the generic advice for a plugin bug.
    """

    exit_code = PLUGIN_HOOK_EXIT_CODE

    def __init__(self, plugin: PluginInfo, hook: str, problem: str, without: str | None = None) -> None:
        super().__init__(f"{plugin.label} {problem}")
        self.plugin = plugin
        self.hook = hook  # the hook's name, or what else of the plugin's failed ("evaluator 'x'", "loss 'x'")
        self.problem = problem  # "raised in forge_lm_step_end: ValueError: boom"
        self.outcome: str | None = None
        self.without = without or f"--block-plugin {plugin.name}"  # how to run without what failed

    @property
    def headline(self) -> str:
        """``plugin 'x' (forge-x 1.0) raised in forge_lm_step_end: ValueError: boom``."""
        return f"{self.plugin.label} {self.problem}"

    def __str__(self) -> str:
        block = self.without
        if self.outcome is None:
            return (
                f"{self.headline}. This is a bug in the plugin: report it to its authors, or run without it ({block})."
            )
        return (
            f"{self.headline}. {self.outcome}. Fix the plugin or run without it ({block}), "
            "then run the same command to resume."
        )


def describe(exc: BaseException) -> str:
    """``ValueError: boom`` (or ``ValueError`` when it has no message), on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _CtrlC:
    """Whether a ``KeyboardInterrupt`` is the user's: noted by :func:`noting_ctrl_c`'s SIGINT handler."""

    installed = False  # a handler notes real SIGINTs (else every KeyboardInterrupt is taken for the user's)
    received = False


@contextlib.contextmanager
def noting_ctrl_c() -> Iterator[None]:
    """While inside, a real Ctrl-C (SIGINT) is noted before it raises ``KeyboardInterrupt`` as
    usual, so that one a plugin raises itself is told apart (:func:`from_the_user`) and reported
    as that plugin's failure. Installed by ``forge`` for a command's run, in the main thread,
    only over Python's default handler. Where SIGINT is ignored (a background job of a
    non-interactive shell, ``nohup ... &``), no Ctrl-C can arrive: every ``KeyboardInterrupt``
    is then raised by code, so none is taken for the user's."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        _CtrlC.installed, _CtrlC.received = True, False
        try:
            yield
        finally:
            _CtrlC.installed = False
        return
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return

    def note(signum: int, frame: Any) -> None:
        _CtrlC.received = True
        raise KeyboardInterrupt

    _CtrlC.installed, _CtrlC.received = True, False
    signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _CtrlC.installed = False


def from_the_user(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's Ctrl-C: a ``KeyboardInterrupt`` after a real SIGINT, or any
    ``KeyboardInterrupt`` where nothing notes SIGINTs. Raised by a plugin's code without one, it
    is that plugin's failure, like any other exception."""
    return isinstance(exc, KeyboardInterrupt) and (_CtrlC.received or not _CtrlC.installed)


def working_directory() -> str:
    try:
        return os.getcwd()
    except OSError:  # removed from under the process
        return "(a removed directory)"


def moved_directory(before: str) -> str | None:
    """The working directory, if a plugin's code changed it from ``before`` (it is put back):
    relative paths of the run (its output directory, data files) would point elsewhere."""
    now = working_directory()
    if now == before:
        return None
    with contextlib.suppress(OSError):  # the old one is gone: nothing to put back
        os.chdir(before)
    return now


def moved_problem(call: str, before: str, now: str) -> str:
    return (
        f"changed the working directory in {call} from '{before}' to '{now}'; a plugin must not (relative paths of "
        "the run would point elsewhere); it was put back"
    )


def call_each(
    implementations: Iterable[Any],
    plugin_of: Callable[[str], PluginInfo],
    hook: str,
    arguments: Callable[[str], Mapping[str, Any] | None],
    *,
    first: bool = False,
    on_failure: Callable[[PluginHookFailed], None] | None = None,
    passes: tuple[type[BaseException], ...] = (),
) -> list[tuple[PluginInfo, Any]]:
    """Call each implementation (in the order given) with the arguments it names.

    ``arguments(plugin_name)`` gives the keyword arguments for that plugin's implementation,
    or None to skip it. Returns ``(plugin, result)`` for every result that is not None, as
    pluggy collects them; ``first`` stops at the first one (``firstresult`` hooks).

    Anything an implementation raises, ``SystemExit`` and a ``KeyboardInterrupt`` that is not
    the user's Ctrl-C included (:func:`from_the_user`: a plugin decides neither that the process
    ends nor that the user interrupted it), becomes a :class:`PluginHookFailed`: raised, or
    passed to ``on_failure`` and the next implementation called; so does an implementation that
    changes the working directory (put back first). The user's Ctrl-C passes through untouched;
    so do the exception types in ``passes`` (``forge_lm_configure`` lets a plugin's ConfigError
    through).
    """
    results: list[tuple[PluginInfo, Any]] = []
    for impl in implementations:
        kwargs = arguments(impl.plugin_name)
        if kwargs is None:
            continue
        directory = working_directory()
        try:
            result = impl.function(**{name: kwargs[name] for name in impl.argnames})
            moved = moved_directory(directory)
        except BaseException as exc:  # any failure of a plugin, SystemExit included, is reported naming it
            moved_directory(directory)
            if isinstance(exc, passes) or from_the_user(exc):
                raise
            failure = PluginHookFailed(plugin_of(impl.plugin_name), hook, f"raised in {hook}: {describe(exc)}")
            if on_failure is None:
                raise failure from exc
            on_failure(failure)
            continue
        if moved is not None:
            failure = PluginHookFailed(plugin_of(impl.plugin_name), hook, moved_problem(hook, directory, moved))
            if on_failure is None:
                raise failure
            on_failure(failure)
            continue
        if result is not None:
            results.append((plugin_of(impl.plugin_name), result))
            if first:
                break
    return results


def checked_metrics(value: object, reserved: Collection[str]) -> tuple[dict[str, float], list[str]]:
    """The usable part of what a ``step_end``/``eval_end`` implementation returned, and what
    was wrong with the rest.

    Usable: a dict of non-empty string keys to real numbers (int or float, NaN and Inf
    included; not bool), each converted to float, whose key is not in ``reserved`` (the
    core's own metrics, which a plugin may not overwrite).
    """
    if not isinstance(value, Mapping):
        return {}, [f"a {type(value).__name__} instead of a dict of metric names to numbers"]
    good: dict[str, float] = {}
    problems: list[str] = []
    for key, number in value.items():
        if not isinstance(key, str) or not key:
            problems.append(f"key {short_repr(key)} is not a non-empty string")
        elif key in reserved:
            problems.append(f"'{key}' would overwrite the core's own metric")
        elif isinstance(number, bool) or not isinstance(number, numbers.Real):
            hint = " (call .item() on it)" if hasattr(number, "item") else ""
            problems.append(f"'{key}' is a {type(number).__name__}, not a number{hint}")
        else:
            try:
                good[key] = float(number)
            except Exception as exc:  # noqa: BLE001 - a number-like object whose float() fails is garbage
                problems.append(f"'{key}' is not a float ({describe(exc)})")
    return good, problems


def checkpoint_problem(value: object, path: str) -> str | None:
    """What in ``value`` a checkpoint cannot keep, or None: tensors and plain data (None,
    bool, int, float, str, lists, tuples, dicts with str or int keys) only, as
    :mod:`forge_lm.checkpoint` stores them without pickling; nested at most
    :data:`forge_lm.plain_data.MAX_DEPTH` levels, and containing no cycle."""
    found = find_not_plain(value, tensors=True, int_keys=True, non_finite=True)
    if found is None:
        return None
    suffix = "; checkpoints keep tensors and plain data only" if found.kind == "type" else ""
    return f"'{found.at(path, subscripts=True)}' {found.reason}{suffix}"
