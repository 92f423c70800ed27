"""What the core needs of a built component, checked where it is built.

A factory's return value is untrusted: one that returns None, or an object without the
methods the core calls, would otherwise fail later, at a place that names someone else (the
scheduler built from a broken optimizer) or in the middle of training. :data:`CONTRACTS`
holds, per category, a check of the object's basic shape (types and methods only: nothing is
called; the methods are those of the category's protocol in :mod:`forge_lm.components`);
:func:`contract_problem` says what is wrong, and :meth:`forge_lm.plugins.Component.build_for_run`
turns that into a PluginError naming the component and its plugin. Categories without an entry
are checked where they are used (feed-forward layers, routers and model transforms).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from forge_lm.components import Evaluator, MetricsBackend, Scheduler, StatefulDataset, protocol_methods


def _short_type(value: object) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def _missing(value: object, methods: tuple[str, ...]) -> list[str]:
    missing = []
    for name in methods:
        try:
            found = callable(getattr(value, name, None))
        except Exception:  # noqa: BLE001 - a property of a plugin's object may raise when read
            found = False
        if not found:
            missing.append(f"{name}()")
    return missing


def _lacking(value: object, missing: list[str]) -> str:
    return "None" if value is None else f"a {type(value).__name__} without {', '.join(missing)}"


def _protocol(protocol: type, expected: str) -> Callable[[object], str | None]:
    """A check for the methods ``protocol`` (of :mod:`forge_lm.components`) declares, so the
    list the core checks and the contract plugins read are one."""
    methods = protocol_methods(protocol)

    def check(value: object) -> str | None:
        missing = _missing(value, methods)
        if not missing:
            return None
        return f"{_lacking(value, missing)}; the core needs {expected}"

    return check


def _optimizer(value: object) -> str | None:
    torch = sys.modules.get("torch")
    if torch is None or isinstance(value, torch.optim.Optimizer):
        return None
    return f"{_short_type(value)}, not a torch.optim.Optimizer"


def _loss(value: object) -> str | None:
    if callable(value):
        return None
    return f"{_short_type(value)}, not a callable loss_fn(logits, labels) -> 0-d tensor"


def _dataset(value: object) -> str | None:
    methods = protocol_methods(StatefulDataset)
    missing = _missing(value, tuple(name for name in methods if name != "__iter__"))
    if not callable(getattr(type(value), "__iter__", None)):  # iter() looks on the type, not the instance
        missing.insert(0, "__iter__()")
    if not missing:
        return None
    needs = "an iterable of samples with state_dict() and load_state_dict(state)"
    return f"{_lacking(value, missing)}; the core needs {needs}"


CONTRACTS: dict[str, Callable[[object], str | None]] = {
    "optimizers": _optimizer,
    "schedulers": _protocol(
        Scheduler, "a scheduler with step(), state_dict() and load_state_dict(state) (a torch LRScheduler)"
    ),
    "losses": _loss,
    "datasets": _dataset,
    "evaluators": _protocol(Evaluator, "an evaluator with evaluate(model, step) -> dict[str, float]"),
    "metrics_backends": _protocol(MetricsBackend, "a metrics backend with start(), log() and finish()"),
}


def contract_problem(category: str, value: object) -> str | None:
    """What is wrong with ``value`` as a built component of ``category`` (None: nothing the
    core can see without using it)."""
    check = CONTRACTS.get(category)
    return None if check is None else check(value)
